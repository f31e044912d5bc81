"""CUDA checks: the same model on the GPU (fp32 and bf16), the KV cache, a bf16 training step
and the service's device/dtype choice. CI has no GPU: every test here skips without one."""

from __future__ import annotations

import pytest
import torch

from attnlens.model import SamplingParams, generate_tokens, load_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine"),
]


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint), load_checkpoint(tiny_checkpoint, device="cuda")


def test_cuda_fp32_logits_and_attention_match_the_cpu(pair):
    cpu, gpu = pair
    ids = torch.randint(0, cpu.config.vocab_size, (2, 48))
    ref, ref_att = cpu.model(ids, return_attention=True)
    out, att = gpu.model(ids.cuda(), return_attention=True)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(att, ref_att):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)


def test_cuda_kv_cache_matches_full_recompute(pair):
    _, gpu = pair
    ids = torch.randint(0, gpu.config.vocab_size, (1, 40), device="cuda")
    full = gpu.model(ids).logits
    cache = gpu.model.new_kv_cache(1)
    steps = [gpu.model(ids[:, :8], kv_cache=cache).logits]
    steps += [gpu.model(ids[:, t : t + 1], kv_cache=cache).logits for t in range(8, 40)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-4)


def test_bf16_greedy_decoding_runs_and_is_seeded(tiny_checkpoint):
    ckpt = load_checkpoint(tiny_checkpoint, device="cuda", dtype=torch.bfloat16)
    ids = ckpt.tokenizer.encode("To be, or not")
    params = SamplingParams(temperature=0.9, seed=3)
    a = [t.id for t in generate_tokens(ckpt.model, ids, 20, params)]
    b = [t.id for t in generate_tokens(ckpt.model, ids, 20, params)]
    assert a == b and len(a) == 20


def test_bf16_autocast_training_step_lowers_the_loss(tiny_checkpoint):
    ckpt = load_checkpoint(tiny_checkpoint, device="cuda")
    model = ckpt.model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    x = torch.randint(0, ckpt.config.vocab_size, (4, 32), device="cuda")
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_service_picks_cuda_and_bf16_on_auto(tiny_checkpoint):
    from fastapi.testclient import TestClient

    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings

    with TestClient(create_app(Settings(model=tiny_checkpoint, device="auto", dtype="auto"))) as client:
        info = client.get("/model").json()
        assert info["device"].startswith("cuda") and info["dtype"] == "bfloat16"
        r = client.post("/generate", json={"prompt": "To be", "max_new_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_cuda_graph_decode_equals_the_eager_step(pair):
    """The captured decode step (two CUDA graphs per batch bucket: plain and with attention)
    gives the eager step's logits, tokens and attention rows."""
    from attnlens.model.cuda_graphs import GraphedDecoder
    from attnlens.model.decoding import RowSampler, decode_step

    _, gpu = pair
    model = gpu.model
    plain, graphed = model.new_kv_cache(8), model.new_kv_cache(8)
    decoder = GraphedDecoder(model, graphed)
    assert decoder.capture and set(decoder.graphs) == {(b, att) for b in (1, 2, 4, 8) for att in (False, True)}
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    samplers = [RowSampler(SamplingParams(temperature=0)) for _ in prompts]
    with torch.inference_mode():
        for cache in (plain, graphed):
            for row, ids in enumerate(prompts):
                model(torch.tensor([ids], device="cuda"), kv_cache=cache, rows=slice(row, row + 1))
        last = torch.tensor([[10], [11], [12]], device="cuda")
        for step in range(12):
            samplers[2].return_attention = step % 3 == 1  # now and then a row streams its attention
            a = decode_step(model, plain, last, samplers)
            b = decode_step(model, graphed, last, samplers, graphs=decoder)
            torch.testing.assert_close(b.output.logits, a.output.logits, rtol=1e-4, atol=1e-4)
            assert [t.id for t in a.tokens] == [t.id for t in b.tokens]
            for ra, rb in zip(a.tokens[2].attention or [], b.tokens[2].attention or []):
                torch.testing.assert_close(rb, ra, rtol=0, atol=1e-5)
            assert (a.tokens[2].attention is None) == (b.tokens[2].attention is None) == (step % 3 != 1)
            last = torch.tensor([[t.id] for t in a.tokens], device="cuda")


def _greedy_engine_answers_are_each_alone(ckpt, engine, prompts: list[str], n: int) -> None:
    """Greedy generations of `prompts` submitted to `engine` at once give the tokens the model gives
    each alone (up to EOS); the engine is closed after."""
    import asyncio

    from helpers import reference_ids, run_async

    from attnlens.app.engine import GenerationParams
    from attnlens.app.engine.outputs import TokenEvent

    async def main():
        gens = engine.submit_all([GenerationParams(ckpt.tokenizer.encode(p), n, SamplingParams(temperature=0))
                                  for p in prompts])

        async def ids(g):
            return [e.id for e in [e async for e in g.events()] if isinstance(e, TokenEvent)]

        return await asyncio.gather(*(ids(g) for g in gens))

    try:
        got = run_async(main())
    finally:
        engine.close()
    for p, tokens in zip(prompts, got):
        assert tokens == reference_ids(ckpt, p, n, temperature=0.0), p


def test_engine_on_cuda_with_graphs_matches_generate_tokens(tiny_checkpoint):
    from attnlens.app.engine import Engine

    ckpt = load_checkpoint(tiny_checkpoint, device="cuda")
    engine = Engine(ckpt, max_concurrent=4, max_queue=4)
    assert engine.client.core.graphs is not None
    _greedy_engine_answers_are_each_alone(ckpt, engine, ["To be", "Or not", "The slings", "No more", "Whether"], 16)


def test_long_prompts_prefilled_in_pieces_on_cuda_beside_graphed_decode_steps(tiny_checkpoint):
    """Chunked prefill on CUDA: prompts longer than `prefill_chunk` go in 5-token pieces into the
    row after the decoding ones while short ones decode from the captured graphs; each request's
    greedy tokens are what the model gives it alone."""
    from attnlens.app.engine import Engine

    ckpt = load_checkpoint(tiny_checkpoint, device="cuda")
    engine = Engine(ckpt, max_concurrent=4, max_queue=8, prefill_chunk=5)
    assert engine.client.core.graphs is not None
    prompts = ["To be", "Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune",
               "Or not", "Or to take arms against a sea of troubles, and by opposing end them", "The slings"]
    assert sum(len(ckpt.tokenizer.encode(p)) > 3 * 5 for p in prompts) == 2
    _greedy_engine_answers_are_each_alone(ckpt, engine, prompts, 12)


def test_every_bundled_family_serves_on_cuda_as_on_the_cpu(default_checkpoint):
    """The bundled decoder, encoder and translator served on CUDA (auto: bf16; the decoder's steps
    from CUDA graphs) answer like the same models in fp32 on the CPU: the same translation, the
    same top fill-mask token and genre, the same first greedy tokens."""
    from fastapi.testclient import TestClient

    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings

    requests = [
        ("/generate", {"model": "translator", "prompt": "Wednesday, March 3, 2021", "temperature": 0,
                       "max_new_tokens": 20}, lambda r: r["text"]),
        ("/fill-mask", {"model": "encoder", "text": "O Romeo, Romeo! wherefore art thou [MASK]?", "top_k": 3},
         lambda r: r["masks"][0][0]["token"]),
        ("/classify", {"model": "encoder", "text": "My liege, the French are landed at Southampton."},
         lambda r: r["labels"][0]["label"]),
        ("/generate", {"prompt": "ROMEO.\n", "temperature": 0, "max_new_tokens": 3, "logprobs": 1},
         lambda r: r["text"]),
    ]
    answers = {}
    for device in ("cpu", "auto"):
        with TestClient(create_app(Settings(device=device, dtype="auto", warmup=False))) as client:
            models = {m["name"]: m for m in client.get("/models").json()["models"]}
            assert {"default", "encoder", "translator"} <= set(models)
            info = client.get("/model").json()
            assert info["device"].startswith("cuda" if device == "auto" else "cpu")
            answers[device] = []
            for path, body, pick in requests:
                r = client.post(path, json=body)
                assert r.status_code == 200, (device, path, r.text)
                answers[device].append(pick(r.json()))
    assert answers["auto"] == answers["cpu"]


@pytest.fixture
def sdpa_calls(monkeypatch):
    """(device, cuDNN attention allowed) of every scaled_dot_product_attention call."""
    import torch.nn.functional as F

    real, calls = F.scaled_dot_product_attention, []

    def spy(*args, **kwargs):
        calls.append((args[0].device.type, torch.backends.cuda.cudnn_sdp_enabled()))
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def test_eager_attention_on_cuda_runs_without_cudnn_and_its_plan_per_shape(pair, sdpa_calls):
    """cuDNN's attention builds an execution plan for every new (batch, length) shape (80 ms on
    average on an H100), which a prefill of each new prompt length would wait for: eager
    attention on CUDA runs with that backend off (flash / memory-efficient kernels), in
    prefills of every kind and in decode steps."""
    backends = sdpa_calls
    _, gpu = pair
    vocab = gpu.config.vocab_size
    with torch.inference_mode():
        gpu.model(torch.randint(0, vocab, (3, 17), device="cuda"))  # causal, no cache
        cache = gpu.model.new_kv_cache(2)
        gpu.model(torch.randint(0, vocab, (1, 9), device="cuda"), kv_cache=cache, rows=slice(0, 1))
        gpu.model(torch.randint(0, vocab, (2, 1), device="cuda"), kv_cache=cache)  # rows of different lengths
    assert backends and all(device == "cuda" and not cudnn for device, cudnn in backends)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # only around the call: the process setting is left alone


def test_the_captured_decode_step_may_use_cudnn_its_shapes_never_change(pair, sdpa_calls):
    """A CUDA graph's step has fixed shapes: cuDNN's plan is built once, at capture, so there
    every backend may run (cuDNN's masked decode is the fastest on an H100, bench/README.md)."""
    from attnlens.model.cuda_graphs import GraphedDecoder

    _, gpu = pair
    GraphedDecoder(gpu.model, gpu.model.new_kv_cache(2), buckets=(1, 2))
    assert sdpa_calls and all(device == "cuda" and cudnn for device, cudnn in sdpa_calls)
    gpu.model(torch.zeros(1, 5, dtype=torch.long, device="cuda"))  # after the capture: eager again
    assert sdpa_calls[-1] == ("cuda", False)


def test_serving_on_cuda_sets_a_short_gil_switch_interval(tiny_checkpoint):
    """On CUDA the server's default switch interval is 0.2 ms (the model thread gets the GIL
    back from the event loop while the device computes)."""
    import sys

    from fastapi.testclient import TestClient

    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings

    before = sys.getswitchinterval()
    try:
        with TestClient(create_app(Settings(model=tiny_checkpoint, device="cuda", warmup=False))):
            assert sys.getswitchinterval() == pytest.approx(0.0002)
    finally:
        sys.setswitchinterval(before)


# --- imported architectures (Llama 3, Llama 2, Qwen2, Mistral, Qwen3, Pythia) ----------------------


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """name -> the architecture's small random checkpoint (tests/arch_helpers.py), imported once."""
    pytest.importorskip("transformers")
    from arch_helpers import CASES, write_hf_checkpoint

    from attnlens.model.interop.convert import import_checkpoint

    done = {}

    def get(name: str):
        if name not in done:
            root = tmp_path_factory.mktemp(f"gpu-{name}")
            src, _ = write_hf_checkpoint(CASES[name], root / "hf")
            done[name] = import_checkpoint(src, root / "ours")[0]
        return done[name]

    return get


ARCH_NAMES = ["llama3", "llama2", "qwen2", "mistral", "qwen3", "pythia"]


@pytest.mark.parametrize("name", ARCH_NAMES)
def test_each_architecture_on_cuda_matches_the_cpu_and_replays_its_decode_step(imported, name):
    """fp32 on CUDA: logits and every map as on the CPU; the captured decode step (rotary angles
    and Mistral's window from each row's length, GQA over the cache's key/value heads) gives the
    eager step's logits, tokens and attention rows on rows of different lengths."""
    from attnlens.model.cuda_graphs import GraphedDecoder
    from attnlens.model.decoding import RowSampler, decode_step

    cpu, gpu = load_checkpoint(imported(name)), load_checkpoint(imported(name), device="cuda")
    ids = torch.randint(0, cpu.config.vocab_size, (2, 40))
    ref, ref_att = cpu.model(ids, return_attention=True)
    with torch.inference_mode():
        out, att = gpu.model(ids.cuda(), return_attention=True)
        fast = gpu.model(ids.cuda()).logits
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(fast.cpu(), ref, rtol=1e-4, atol=1e-4)
    for a, b in zip(att, ref_att):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)
    model = gpu.model
    plain, graphed = model.new_kv_cache(4), model.new_kv_cache(4)
    decoder = GraphedDecoder(model, graphed)
    assert decoder.capture and graphed.keys[0].shape[1] == gpu.config.kv_heads
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [5, 6], [7, 8, 9]]
    samplers = [RowSampler(SamplingParams(temperature=0)) for _ in prompts]
    with torch.inference_mode():
        for cache in (plain, graphed):
            for row, p in enumerate(prompts):
                model(torch.tensor([p], device="cuda"), kv_cache=cache, rows=slice(row, row + 1))
        last = torch.tensor([[10], [11], [12]], device="cuda")
        for step in range(12):
            samplers[0].return_attention = step % 3 == 1
            a = decode_step(model, plain, last, samplers)
            b = decode_step(model, graphed, last, samplers, graphs=decoder)
            torch.testing.assert_close(b.output.logits, a.output.logits, rtol=1e-4, atol=1e-4)
            assert [t.id for t in a.tokens] == [t.id for t in b.tokens]
            for ra, rb in zip(a.tokens[0].attention or [], b.tokens[0].attention or []):
                torch.testing.assert_close(rb, ra, rtol=0, atol=1e-5)
            last = torch.tensor([[t.id] for t in a.tokens], device="cuda")


@pytest.mark.parametrize("name", ARCH_NAMES)
def test_each_architecture_decodes_in_bf16_on_cuda(imported, name):
    """bf16 (the service's default on a GPU): the rotary frequencies stay float32, the logits stay
    close to fp32's, and seeded sampling through the engine's CUDA graphs is reproducible."""
    import asyncio

    from helpers import run_async

    from attnlens.app.engine import Engine, GenerationParams
    from attnlens.app.engine.outputs import TokenEvent

    ckpt = load_checkpoint(imported(name), device="cuda", dtype=torch.bfloat16)
    fp32 = load_checkpoint(imported(name), device="cuda")
    if ckpt.model.rotary is not None:
        assert ckpt.model.rotary.inv_freq.dtype == torch.float32
    ids = torch.randint(0, ckpt.config.vocab_size, (1, 32), device="cuda")
    with torch.inference_mode():
        want = fp32.model(ids).logits
        diff = (ckpt.model(ids).logits.float() - want).abs().max().item()
    assert diff < 0.05 * want.abs().max().item() + 0.05, diff
    engine = Engine(ckpt, max_concurrent=4, max_queue=4)
    assert engine.client.core.graphs is not None
    params = SamplingParams(temperature=0.9, seed=3)

    async def main():
        gens = engine.submit_all([GenerationParams([1, 2, 3, 4], 16, params), GenerationParams([5, 6], 16, params)])

        async def ids(g):
            return [e.id for e in [e async for e in g.events()] if isinstance(e, TokenEvent)]

        return await asyncio.gather(*(ids(g) for g in gens))

    try:
        first, second = run_async(main()), run_async(main())
    finally:
        engine.close()
    assert first == second and all(len(t) >= 1 for t in first)


def test_encoder_embeddings_clark_scores_and_a_classifier_with_its_own_blocks_on_cuda(tmp_path):
    """/v1/embeddings, /heads' Clark scores and /classify through a genre head's own top block
    (classifier_layers) answer on CUDA in float32 as on the CPU."""
    from fastapi.testclient import TestClient

    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings
    from attnlens.model import load_checkpoint
    from attnlens.model.checkpoint import save_checkpoint
    from attnlens.model.training.encoder_heads import genre_model

    base = load_checkpoint("checkpoints/encoder")
    torch.manual_seed(0)
    branched = genre_model(base.model, 1)
    with torch.no_grad():
        for p in branched.classifier_blocks.parameters():
            p.add_(0.05 * torch.randn_like(p))  # its own block differs from the shared one
    path = save_checkpoint(tmp_path / "branched", branched, base.tokenizer)
    texts = ["O Romeo, Romeo! wherefore art thou Romeo?", "My liege, the French are landed."]
    answers = {}
    for device in ("cpu", "cuda"):
        settings = Settings(model=path, models=[path], device=device, dtype="float32", warmup=False)
        with TestClient(create_app(settings)) as client:
            emb = client.post("/v1/embeddings", json={"model": "branched", "input": texts}).json()
            heads = client.post("/heads", json={"model": "branched", "text": texts[0]}).json()
            cls = client.post("/classify", json={"model": "branched", "text": texts[1]}).json()
        clark = [[h["scores"]["clark_cls"], h["scores"]["clark_entropy"]] for row in heads["groups"][0]["heads"] for h in row]
        answers[device] = (torch.tensor([d["embedding"] for d in emb["data"]]), torch.tensor(clark),
                           torch.tensor([label["score"] for label in cls["labels"]]))
    for cpu, cuda in zip(answers["cpu"], answers["cuda"]):
        assert torch.allclose(cpu, cuda, atol=1e-4), (cpu - cuda).abs().max()
