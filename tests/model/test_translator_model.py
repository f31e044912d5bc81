"""The committed translator: loads as an encoder-decoder, and meets the held-out exact match
its report claims, recomputed here on a sample of the same held-out pairs."""

from __future__ import annotations

import math

import pytest
from conftest import REPO_ROOT

from attnlens.model import load_checkpoint
from attnlens.model.data.translation_pairs import held_out_sample, is_held_out
from attnlens.model.families.encoder_decoder import EncoderDecoder, greedy_translate
from attnlens.model.training.train_translation import exact_match

SAMPLE = 200  # held-out pairs of each kind recomputed here (the report used the first 2000)


@pytest.fixture(scope="module")
def translator():
    path = REPO_ROOT / "checkpoints" / "translator"
    if not (path / "model.safetensors").is_file():
        pytest.skip("the bundled translator is not in checkpoints/translator")
    return load_checkpoint(path)


def test_translator_is_a_small_post_ln_encoder_decoder(translator):
    cfg = translator.config
    assert isinstance(translator.model, EncoderDecoder)
    assert (cfg.family, cfg.norm, cfg.positional) == ("encoder-decoder", "post", "sinusoidal")
    size = sum(p.stat().st_size for p in translator.path.iterdir() if p.is_file())
    assert size <= 10 * 1024 * 1024
    assert (translator.path / "loss.png").read_bytes()[:4] == b"\x89PNG"


def test_report_gives_exact_match_per_kind_with_mistakes(translator):
    report = translator.report
    assert report["held_out_rule"] == "int(sha256(source).hexdigest(), 16) % 10 == 0"
    for kind in ("dates", "numbers"):
        part = report[f"held_out_{kind}"]
        assert part["n"] >= 1000
        assert part["exact_match"] == part["correct"] / part["n"]
        for m in part["mistakes"]:
            assert is_held_out(m["source"]) and m["got"] != m["expected"]
    # every held-out pair (python -m attnlens.model.evaluation.evaluate_translation): ~22,000 dates, ~100,000 numbers
    for kind, n in (("dates", 20000), ("numbers", 95000)):
        part = report["held_out_all"][kind]
        assert part["n"] >= n and part["exact_match"] >= 0.97
        assert all(is_held_out(m["source"]) for m in part["mistakes"])


@pytest.mark.parametrize("kind", ["date", "number"])
def test_held_out_exact_match_is_what_the_report_claims(translator, kind):
    pairs = held_out_sample(kind, SAMPLE, seed=translator.report["eval_seed"])
    result = exact_match(translator.model, translator.tokenizer, pairs)
    claimed = translator.report[f"held_out_{kind}s"]["exact_match"]
    # the report's own mistakes that fall in this sample are made again, word for word
    listed = {m["source"]: m["got"] for m in translator.report[f"held_out_{kind}s"]["mistakes"]}
    again = {m["source"]: m["got"] for m in result["mistakes"]}
    for source in set(listed) & {p.source for p in pairs}:
        assert again.get(source) == listed[source]
    # this sample is the start of the report's: its accuracy is within 3 standard errors
    sigma = math.sqrt(max(claimed * (1 - claimed), 0.01) / SAMPLE)
    assert result["accuracy"] >= claimed - 3 * sigma, (result["accuracy"], claimed)


def test_translates_the_issue_examples(translator):
    got = greedy_translate(translator.model, translator.tokenizer, ["ninety-seven", "Wednesday, March 3, 2021"])
    assert got == ["quatre-vingt-dix-sept", "mercredi 3 mars 2021"]
