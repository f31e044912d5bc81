"""The family contract (model/families/contract.py): every family declares its tasks, attention
groups and generation, its module offers what the declaration says, and the service reads the
declaration rather than a family's name (a fourth family declared here is served unchanged)."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient
from helpers import REPO_ROOT, TINY_TEXT

from attnlens.app.server.main import create_app
from attnlens.app.server.settings import Settings
from attnlens.model import ModelConfig, Tokenizer, load_checkpoint, save_checkpoint
from attnlens.model.decoding import RowSampler, SamplingParams, decode_step
from attnlens.model.families import (
    FAMILIES,
    FAMILY_CLASSES,
    AttentionGroup,
    Family,
    GenerationSpec,
    TaskSpec,
    Transformer,
    family_of,
)
from attnlens.model.families.contract import AnalysableModel, FixedShapeDecoder, GenerativeModel
from attnlens.model.family_parts import FAMILY_PARTS

SMALL = dict(vocab_size=64, context_length=16, d_model=16, n_layers=2, n_heads=2, d_ff=32)


def small(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    extra = {"labels": ["a", "b"]} if family == "encoder" else {}
    return FAMILY_CLASSES[family](ModelConfig(family=family, **SMALL, **extra)).eval()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_module_carries_its_declaration_and_offers_what_it_declares(name):
    model = small(name)
    family = family_of(model)
    assert family is FAMILIES[name] and family.name == name == model.config.family
    assert isinstance(model, AnalysableModel)
    assert (family.generation is not None) == isinstance(model, GenerativeModel)
    # the forward returns the family's own output type, not another family's
    ids = torch.tensor([[1, 2, 3]])
    out = model(ids, source=ids) if family.takes_target else model(ids)
    assert type(out) is family.output


@pytest.mark.parametrize("name", list(FAMILIES))
def test_analyse_gives_every_declared_group_over_its_declared_axes(name):
    model = small(name)
    family = family_of(model)
    ids = [5, 6, 7, 8, 9]
    target = [10, 11, 12] if family.takes_target else None
    analysis = model.analyse(ids, target)
    assert set(analysis.maps) == {g.name for g in family.groups}
    assert set(analysis.tokens) == set(family.axes)
    L, H = model.config.n_layers, model.config.n_heads
    for g in family.groups:
        Q, K = len(analysis.tokens[g.queries]), len(analysis.tokens[g.keys])
        maps = analysis.maps[g.name]
        assert maps.shape == (L, H, Q, K)
        torch.testing.assert_close(maps.sum(-1), torch.ones(L, H, Q))  # each row a distribution
        upper = torch.triu(torch.ones(Q, K, dtype=torch.bool), diagonal=1)
        assert bool((maps[..., upper] == 0).all()) == g.causal or Q == 1


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f.generation is not None])
def test_a_step_streams_exactly_the_declared_step_groups(name):
    model = small(name)
    family = family_of(model)
    cache = model.new_kv_cache(2)
    samplers = [RowSampler(SamplingParams(temperature=0.0), return_attention=True) for _ in range(2)]
    with torch.inference_mode():
        step = decode_step(model, cache, torch.tensor([[1, 2, 3], [4, 5, 0]]), samplers, n_new=[3, 2])
        step = decode_step(model, cache, torch.tensor([[t.id] for t in step.tokens]), samplers)
    cross = [g for g in family.generation.step_groups if family.group(g).is_cross]
    for b, token in enumerate(step.tokens):
        assert token.attention is not None and (token.cross_attention is not None) == bool(cross)
        assert len(token.attention) == model.config.n_layers
        # each row over its own keys only: row 1 holds one position fewer than row 0
        assert token.attention[0].shape[-1] == int(cache.lengths[b])


def test_each_family_has_an_output_type_of_its_own():
    outputs = [f.output for f in FAMILIES.values()]
    assert len(set(outputs)) == len(outputs)


def test_fixed_shape_decoding_is_declared_by_the_module_not_the_name():
    assert isinstance(small("decoder"), FixedShapeDecoder)
    assert not isinstance(small("encoder-decoder"), FixedShapeDecoder)


def test_task_needs_are_read_from_the_checkpoint_features():
    decoder, encoder = FAMILIES["decoder"], FAMILIES["encoder"]
    assert decoder.task_names() == ["generate", "completions", "attention"]
    assert decoder.task_names({"chat_template"}) == ["generate", "completions", "chat", "attention"]
    assert encoder.task_names() == ["attention", "embeddings"]  # no masked-LM head (a BertModel), no labels
    assert encoder.task_names({"mlm_head"}) == ["fill-mask", "attention", "embeddings"]
    assert encoder.task_names({"mlm_head", "labels"}) == ["fill-mask", "classify", "attention", "embeddings"]


def test_a_declaration_that_names_an_unknown_step_group_is_refused():
    with pytest.raises(ValueError, match="step groups"):
        Family(name="x", description="", tasks=(), groups=(AttentionGroup("self", "tokens", "tokens", True, ""),),
               attention_kind="causal", output=tuple, generation=GenerationSpec("prefix", ("cross",)))


# --- a fourth family, declared here: the service serves it without knowing its name ---------
LOOKBACK = Family(
    name="lookback-lm",
    description="a test family: the decoder's stack under another name, group and task list",
    tasks=(TaskSpec("generate"), TaskSpec("attention")),
    groups=(AttentionGroup("lookback", "tokens", "tokens", causal=True, description="causal, renamed"),),
    attention_kind="causal",
    output=Transformer.family.output,
    generation=GenerationSpec(prompt="prefix", step_groups=("lookback",)),
)


class LookbackLM(Transformer):
    family = LOOKBACK

    def analyse(self, ids, target_ids=None):
        analysis = super().analyse(ids, target_ids)
        return type(analysis)(analysis.tokens, {"lookback": analysis.maps["self"]})

    def step_attention(self, output, cache, rows, queries):
        return [{"lookback": maps["self"]} for maps in super().step_attention(output, cache, rows, queries)]


@pytest.fixture
def lookback_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setitem(FAMILY_CLASSES, LOOKBACK.name, LookbackLM)
    monkeypatch.setitem(FAMILIES, LOOKBACK.name, LOOKBACK)
    monkeypatch.setitem(FAMILY_PARTS, LOOKBACK.name, LOOKBACK.builds)  # what the config validates against
    tok = Tokenizer.train([TINY_TEXT] * 4, vocab_size=300)
    torch.manual_seed(0)
    model = LookbackLM(ModelConfig(family=LOOKBACK.name, vocab_size=tok.vocab_size, context_length=32, d_model=16,
                                   n_layers=2, n_heads=2, d_ff=32))
    save_checkpoint(tmp_path / "lookback", model, tok)
    assert isinstance(load_checkpoint(tmp_path / "lookback").model, LookbackLM)
    return tmp_path / "lookback"


def test_a_fourth_family_is_served_from_its_declaration_alone(lookback_checkpoint):
    settings = Settings(model=lookback_checkpoint, device="cpu", engine_process=False)  # the family is this process's
    with TestClient(create_app(settings)) as c:
        summary = c.get("/models").json()["models"][0]
        assert summary["family"] == "lookback-lm" and summary["tasks"] == ["generate", "attention"]
        assert [g["name"] for g in summary["family_info"]["groups"]] == ["lookback"]
        r = c.post("/attention", json={"text": "To be, or not", "packing": "tril", "format": "f16"})
        assert r.status_code == 200 and r.json()["family"] == "lookback-lm" and r.json()["packing"] == "tril"
        r = c.post("/generate", json={"prompt": "To be", "max_new_tokens": 3, "temperature": 0,
                                      "return_attention": True})
        assert r.status_code == 200 and len(r.json()["attention"]) == 3 and r.json()["cross_attention"] is None
        r = c.post("/v1/completions", json={"prompt": "To be", "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_task"  # not among its tasks


def test_the_config_knows_the_families_and_their_parts_as_the_declarations_do():
    """model/family_parts.py (what ModelConfig validates against, without importing the families)
    lists exactly the declared families, in order, each with the parts its declaration builds."""
    assert list(FAMILY_PARTS) == list(FAMILIES)
    assert all(FAMILIES[name].builds == parts for name, parts in FAMILY_PARTS.items())


PART_CONFIGS = {  # a config that asks for each optional part
    "rotary": dict(positional="rotary"), "sliding_window": dict(positional="rotary", sliding_window=3),
    "rmsnorm": dict(norm_type="rmsnorm"), "grouped_query": dict(n_kv_heads=1),
    "parallel_residual": dict(parallel_residual=True), "classifier": dict(labels=["a", "b"]),
}


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("part", list(PART_CONFIGS))
def test_a_family_builds_exactly_the_optional_parts_it_declares(name, part):
    from attnlens.model import ConfigError

    fields = {**SMALL, **PART_CONFIGS[part], "family": name}
    if part not in FAMILIES[name].builds:
        with pytest.raises(ConfigError, match=f"the {name} family does not build .*{part}"):
            ModelConfig(**fields)
        return
    config = ModelConfig(**fields)
    assert part in config.parts_used()
    torch.manual_seed(0)
    model = FAMILY_CLASSES[name](config).eval()
    analysis = model.analyse([5, 6, 7, 8, 9], [1, 2] if FAMILIES[name].takes_target else None)
    assert all(bool(torch.isfinite(m).all()) for m in analysis.maps.values())


def test_training_is_read_from_each_family_declaration(tmp_path):
    """`attnlens train` picks its objective, data and tokenizer from Family.training, not from
    the family's name: every bundled family declares one whose objective resolves, and a family
    that declares none is refused with a line that says so."""
    from dataclasses import replace

    from attnlens.model.families import FAMILIES
    from attnlens.model.training.train import Objective

    for family in FAMILIES.values():
        assert family.training is not None, family.name
        assert issubclass(family.training.objective_class(), Objective), family.name
    assert FAMILIES["encoder-decoder"].training.data == "own"
    assert FAMILIES["encoder"].training.tokenizer == "corpus_specials"
    untrainable = replace(FAMILIES["decoder"], training=None)
    import attnlens.model.training.train as train_module
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_module, "family_named", lambda name: untrainable)
        with pytest.raises(ValueError, match="declares no training"):
            train_module.train(train_module.load_run_config(REPO_ROOT / "configs" / "default.toml",
                                                            ["train.max_steps=1", "train.threads=0"]), tmp_path / "out")
