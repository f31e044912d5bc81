"""Our head scores (model/evaluation/evaluate_decoder.py) against TransformerLens's own head detector.

TransformerLens loads the GPT-2 that `export-hf` writes (TransformerBridge over transformers,
offline from the directory) and scores its attention patterns with head_detector.py's
functions; ours read our model's maps. The two must agree on every head, for the induction,
previous-token and duplicate-token patterns, and for `detect_head` itself on a text prompt.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import TINY_TEXT
from helpers import sharp_checkpoint

from attnlens.model.checkpoint import load_checkpoint
from attnlens.model.evaluation.evaluate_decoder import (
    PATTERNS,
    head_scores_and_copying,
    induction_pattern,
    mul_score,
    repeated_random_tokens,
)
from attnlens.model.interop.hf import export_hf

tl_head_detector = pytest.importorskip("transformer_lens.head_detector")


def bridge_for(export_dir):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge.boot_transformers(str(export_dir), device="cpu")


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    """A random GPT-2-shaped model whose heads attend sharply (varied, non-trivial scores)."""
    root = tmp_path_factory.mktemp("detector")
    ours = sharp_checkpoint(root, seed=5, context_length=128)
    return load_checkpoint(ours), bridge_for(export_hf(ours, root / "gpt2"))


def tl_scores(bridge, sequences: torch.Tensor) -> dict[str, torch.Tensor]:
    """[pattern] -> (L, H) scores by TransformerLens, averaged over the sequences."""
    makers = {"induction": tl_head_detector.get_induction_head_detection_pattern,
              "previous_token": tl_head_detector.get_previous_token_head_detection_pattern,
              "duplicate_token": tl_head_detector.get_duplicate_token_head_detection_pattern}
    out = {name: torch.zeros(bridge.cfg.n_layers, bridge.cfg.n_heads) for name in makers}
    for seq in sequences:
        _, cache = bridge.run_with_cache(seq[None])
        for name, make in makers.items():
            pattern = make(seq[None].cpu())
            for layer in range(bridge.cfg.n_layers):
                maps = cache["pattern", layer][0]  # (H, T, T)
                for head in range(bridge.cfg.n_heads):
                    out[name][layer, head] += tl_head_detector.compute_head_attention_similarity_score(
                        maps[head], pattern, exclude_bos=False, exclude_current_token=False,
                        error_measure="mul") / len(sequences)
    return out


def test_our_scores_equal_transformer_lens_on_every_head(sharp):
    ours, bridge = sharp
    sequences = repeated_random_tokens(ours.tokenizer, n=3, length=20, seed=1)
    sequences[:, 5] = sequences[:, 9]  # a duplicate inside each copy too
    sequences[:, 25] = sequences[:, 29]
    mine = head_scores_and_copying(ours.model, sequences)["scores"]
    theirs = tl_scores(bridge, sequences)
    for name in PATTERNS:
        assert torch.allclose(mine[name], theirs[name], atol=1e-5), name
        assert float(mine[name].std()) > 1e-3  # the heads differ: the comparison is not vacuous


def test_detect_head_on_a_text_prompt_agrees(sharp):
    ours, bridge = sharp
    text = TINY_TEXT.split("\n")[0] + " " + TINY_TEXT.split("\n")[0]
    tokens = bridge.to_tokens(text)[0]  # TransformerLens prepends BOS (<|endoftext|>)
    assert tokens.tolist() == [ours.tokenizer.eos_id, *ours.tokenizer.encode(text)]
    theirs = tl_head_detector.detect_head(bridge, text, "induction_head", error_measure="mul")
    mine = head_scores_and_copying(ours.model, tokens[None])["scores"]["induction"]
    assert torch.allclose(mine, theirs.float(), atol=1e-5)


def test_induction_pattern_and_mul_score_by_hand():
    tokens = torch.tensor([0, 7, 8, 7, 8])
    pattern = induction_pattern(tokens)
    # query 3 (second 7) -> key 2 (after the first 7); query 4 (second 8) -> key 3 (after the first 8)
    assert pattern.nonzero().tolist() == [[3, 2], [4, 3]]
    attention = torch.tril(torch.ones(5, 5)) / torch.arange(1, 6)[:, None]
    assert float(mul_score(attention, pattern)) == pytest.approx((1 / 4 + 1 / 5) / 5)


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="issue 23 (blocked: no GPU lent): the bundled decoder is not yet retrained "
                   "and has no induction head (best 0.008); when it is, this passes and the mark must go")
def test_bundled_default_model_has_an_induction_head_by_transformer_lens(default_checkpoint, tmp_path):
    """The report's induction figure, recomputed by TransformerLens on the exported weights."""
    ck = load_checkpoint(default_checkpoint)
    bridge = bridge_for(export_hf(default_checkpoint, tmp_path / "gpt2"))
    sequences = repeated_random_tokens(ck.tokenizer, n=4)
    theirs = tl_scores(bridge, sequences)["induction"]
    mine = head_scores_and_copying(ck.model, sequences)["scores"]["induction"]
    assert torch.allclose(mine, theirs, atol=1e-4)
    assert float(theirs.max()) >= 0.3
