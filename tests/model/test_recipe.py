"""The training recipe's pieces: the copying curriculum, the warm-up/stable/decay schedule,
whole-word masking, the fine-tuning's mixed loss and the fill-mask examples."""

from __future__ import annotations

import pytest
import torch
from helpers import REPO_ROOT

from attnlens.model.data.mlm import IGNORE, mask_words, word_edges
from attnlens.model.evaluation.evaluate_encoder import common_word_examples, common_words
from attnlens.model.tokenizer import Tokenizer
from attnlens.model.training.curriculum import batch_with_repeats, repeat_span
from attnlens.model.training.train import TrainSettings, load_run_config, lr_at

TEXT = ("O Romeo, Romeo! wherefore art thou Romeo?\nDeny thy father and refuse thy name;\n"
        "Or, if thou wilt not, be but sworn my love,\nAnd I'll no longer be a Capulet.\n") * 3


@pytest.fixture(scope="module")
def encoder_tokenizer() -> Tokenizer:
    return Tokenizer.train([TEXT] * 5, 300, encoder_tokens=True)


def test_repeat_span_writes_a_span_again_later_and_keeps_the_length():
    g = torch.Generator().manual_seed(0)
    window = torch.arange(100, 164)  # distinct tokens, so the row shows where the copy is
    spans = set()
    for _ in range(50):
        row = repeat_span(window, g, 4, 20)
        assert len(row) == 64
        jumps = ((row[1:] - row[:-1]) != 1).nonzero().flatten() + 1  # where the row stops counting up
        at = int(jumps[0])  # the copy starts here...
        first = int(row[at]) - 100
        assert first < at  # the copy repeats an earlier part of the row
        length = int(jumps[1]) - at if len(jumps) > 1 else 64 - at  # ...and runs until the window resumes
        length = min(length, at - first)  # (a copy right after its span runs on into the window unbroken)
        assert torch.equal(row[:at], window[:at])
        assert torch.equal(row[at : at + length], window[first : first + length])
        assert first + length <= at  # the span appeared earlier in the row
        assert torch.equal(row[at + length :], window[at : 64 - length])  # the window goes on, cut at the end
        spans.add(length)
    assert min(spans) >= 4 and max(spans) <= 20 and len(spans) > 5


def test_batches_with_repeats_are_seeded_and_share_their_rows_as_asked():
    stream = torch.arange(5000)
    x, y = batch_with_repeats(stream, 3, 0, 64, 32, 7, share=0.25, min_span=4, max_span=16)
    x2, _ = batch_with_repeats(stream, 3, 0, 64, 32, 7, share=0.25, min_span=4, max_span=16)
    assert torch.equal(x, x2) and torch.equal(x[:, 1:], y[:, :-1])
    repeated = [(row[1:] != row[:-1] + 1).any() for row in torch.cat([x, y[:, -1:]], dim=1)]
    assert 5 <= sum(repeated) <= 30  # about a quarter of 64 rows
    none, _ = batch_with_repeats(stream, 3, 0, 64, 32, 7, share=0.0, min_span=4, max_span=16)
    assert all(((row[1:] - row[:-1]) == 1).all() for row in none)


def test_wsd_schedule_warms_up_holds_then_decays_to_min_lr():
    s = TrainSettings(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=100, schedule="wsd", decay_steps=20)
    assert lr_at(0, s) == pytest.approx(1e-4) and lr_at(9, s) == pytest.approx(1e-3)
    assert all(lr_at(i, s) == 1e-3 for i in range(10, 80))
    assert lr_at(90, s) < lr_at(85, s) < 1e-3 and lr_at(99, s) == pytest.approx(1e-4)
    longer = TrainSettings(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=200, schedule="wsd", decay_steps=20)
    assert [lr_at(i, longer) for i in range(80)] == [lr_at(i, s) for i in range(80)]  # extending changes no past step


def test_recipe_settings_are_checked(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[model]\n[train]\nmax_steps = 100\nschedule = \"wsd\"\ndecay_steps = 0\n")
    with pytest.raises(ValueError, match="decay_steps"):
        load_run_config(path)
    with pytest.raises(ValueError, match="schedule"):
        load_run_config(path, ["train.schedule=linear"])
    with pytest.raises(ValueError, match="repeat_share"):
        load_run_config(path, ["train.schedule=cosine", "train.repeat_share=1.5"])


def test_whole_word_masking_masks_every_token_of_a_picked_word(encoder_tokenizer):
    tok = encoder_tokenizer
    edges = word_edges(tok, tok.vocab_size)
    ids = torch.tensor([tok.encode(TEXT)] * 8)
    g = torch.Generator().manual_seed(1)
    inputs, labels = mask_words(ids, edges=edges, mask_id=tok.mask_id, special_ids=tok.special_ids,
                                vocab_size=tok.vocab_size, generator=g, mask_prob=0.3)
    starts, ends = edges
    continues = torch.zeros_like(ids, dtype=torch.bool)
    continues[:, 1:] = starts[ids[:, 1:]] & ends[ids[:, :-1]]
    assert continues.any()  # the text has words of several tokens
    picked = labels != IGNORE
    # a token that continues a word is picked exactly when the token before it is
    assert torch.equal(picked[:, 1:][continues[:, 1:]], picked[:, :-1][continues[:, 1:]])
    assert 0.15 < picked.float().mean() < 0.45
    masked = inputs == tok.mask_id
    assert (masked <= picked).all() and masked.sum() > 0.6 * picked.sum()


def test_fill_mask_examples_mask_one_common_word_in_its_context(encoder_tokenizer):
    tok = encoder_tokenizer
    words = common_words([TEXT], 5)
    assert words[0] == "romeo"
    ex = common_word_examples(tok, [TEXT], words, stride=1, context_words=3)
    assert len(ex.rows) > 10 and set(ex.words) <= set(words)
    for row, at, answer in zip(ex.rows, ex.mask_at, ex.answers):
        assert row[0] == tok.cls_id and row[-1] == tok.sep_id and row[at] == tok.mask_id
        assert row.count(tok.mask_id) == 1
        assert tok.decode([answer]).strip().lower() in words
        # three words on each side at most: the row is short
        assert len(row) <= 3 + 2 * 3 * 4


def test_mixed_loss_keeps_the_masked_lm_learning_while_fine_tuning(tmp_path):
    """With classify_mlm_weight the fine-tuning step's gradient reaches the MLM head; without it
    the head idles (the old recipe, which let fine-tuning wash the masked LM out)."""
    from attnlens.model.config import ModelConfig
    from attnlens.model.families import build_model
    from attnlens.model.training.train import RunConfig
    from attnlens.model.training.train_encoder import EncoderObjective

    data = REPO_ROOT / "data" / "shakespeare"
    tok = Tokenizer.train([TEXT] * 5, 300, encoder_tokens=True)
    grads = {}
    for weight in (0.0, 0.5):
        cfg = ModelConfig(family="encoder", vocab_size=tok.vocab_size, context_length=32, d_model=32, n_layers=1,
                          n_heads=2, d_ff=64, labels=["comedy", "history", "tragedy"])
        run = RunConfig(cfg, TrainSettings(data_dir=str(data), max_steps=1, classify_steps=1, batch_size=4,
                                           classify_batch_size=4, classify_mlm_weight=weight, whole_word_mask=True))
        objective = EncoderObjective.__new__(EncoderObjective)  # the data parts a step needs, not the held-out split
        objective.s, objective.cfg, objective.tokenizer, objective.device = run.train, cfg, tok, torch.device("cpu")
        objective.length = cfg.context_length - 2
        from attnlens.model.data.passages import Work, tokenize_works

        works = tokenize_works(tok, [Work(g, "train", TEXT, g) for g in ("comedy", "history", "tragedy")])
        objective.mlm_works, objective.by_genre = works, [[w] for w in works]
        objective.edges = word_edges(tok, cfg.vocab_size)
        torch.manual_seed(0)
        model = build_model(cfg)
        loss = objective.loss(model, 1, objective.batch(1, 0, 0))
        loss.backward()
        grads[weight] = model.mlm_dense.weight.grad
    assert grads[0.0] is None
    assert grads[0.5] is not None and float(grads[0.5].abs().sum()) > 0
