"""GET /: the attention viewer's page from static/index.html (when it exists)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse

from attnlens.app.api.deps import SettingsDep

router = APIRouter(tags=["ui"])


@router.get("/", include_in_schema=False)
async def index(settings: SettingsDep):
    page = settings.static_dir / "index.html"
    if not page.is_file():
        return JSONResponse({"detail": f"no web page is installed ({page} is missing); the API is "
                                       f"at /docs"}, status_code=404)
    return FileResponse(page, media_type="text/html")
