"""POST /fill-mask and POST /classify's serving side (app/api/encoder_routes.py is the thin router): the
text checked by its bytes, then framed and checked off the event loop (app/serving/encoder_tasks.py), one
FillMaskCall or ClassifyCall on the model's side (model/analysis/encoder_outputs.py), and the
answer made of its scores (candidates' texts, labels' names)."""

from __future__ import annotations

from attnlens.app.api.encoder_schemas import ClassifyRequest, ClassifyResponse, FillMaskRequest, FillMaskResponse
from attnlens.app.registry.model_registry import ServedModel
from attnlens.app.server.api_errors import ApiError
from attnlens.app.serving.answer_budget import off_loop
from attnlens.app.serving.encoder_tasks import TaskInputError, candidates, fill_mask_call, framed_ids, ranked_labels
from attnlens.app.serving.prompts import check_text_bytes
from attnlens.model.analysis.operations import ClassifyCall

MAX_MASKS = 32  # [MASK]s in one /fill-mask text (each is one row of top-k work)


def check_text(served: ServedModel, text: str) -> None:
    """A text whose bytes alone prove it cannot fit [CLS] text [SEP] in the context: a 400 before
    it is tokenised (a megabyte would hold the tokenizer, and Python's GIL, for seconds)."""
    cfg = served.checkpoint.config
    check_text_bytes(served.checkpoint.tokenizer, text, cfg.context_length - 2, field="text",
                     limit_name=f"the model's context of {cfg.context_length} with [CLS] and [SEP]")


def input_error(e: TaskInputError) -> ApiError:
    return ApiError(400, str(e), param=e.param, code=e.code)


class EncoderServing:
    """Answers an encoder's tasks (fill-mask, classify), each for the model the route's dependency found."""

    async def fill_mask(self, body: FillMaskRequest, served: ServedModel) -> FillMaskResponse:
        check_text(served, body.text)
        ckpt = served.checkpoint
        try:
            call, spans = await off_loop(fill_mask_call, ckpt, body.text, body.top_k, MAX_MASKS)
        except TaskInputError as e:
            raise input_error(e) from None
        scores = await served.runner.call(call)
        masks = await off_loop(candidates, ckpt.tokenizer, body.text, call, spans, scores)
        return FillMaskResponse(model=served.name, masks=[[c.__dict__ for c in row] for row in masks])

    async def classify(self, body: ClassifyRequest, served: ServedModel) -> ClassifyResponse:
        check_text(served, body.text)
        try:
            ids = await off_loop(framed_ids, served.checkpoint, body.text)
        except TaskInputError as e:
            raise input_error(e) from None
        probs = await served.runner.call(ClassifyCall(ids))
        labels = ranked_labels(served.checkpoint.config.labels, probs)
        return ClassifyResponse(model=served.name, labels=[{"label": label, "score": s} for label, s in labels])
