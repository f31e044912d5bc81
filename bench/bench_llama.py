"""Benchmark an imported Llama-shaped model against `transformers`' LlamaForCausalLM on identical
weights: the CPU by default, one thread; a CUDA device with --device cuda.

    .venv/bin/python bench/bench_llama.py                      # ~100M parameters, CPU, 1 thread
    .venv/bin/python bench/bench_llama.py --layers 4 --reps 3  # a quicker, smaller run
    python bench/bench_llama.py --device cuda --dtype bfloat16  # on a GPU (adds the CUDA-graph loop)

The model is built by transformers from a LlamaConfig with random weights (nothing is
downloaded): d_model 768, 12 layers, 12 query heads over 4 key/value heads (grouped-query
attention), SwiGLU d_ff 2048, RMSNorm, rotary positions (theta 500000), a 32000-token
vocabulary with the head tied to it (as SmolLM ties it): about 100M parameters. It is saved
with save_pretrained, converted with `attnlens import-hf` (model.interop.convert, timed), and
both models are loaded in this one process. Timed, ours and transformers taking turns in each
repetition (bench_model.paired_ms):

* forward over T tokens (default 256), without maps (ours: SDPA; transformers: sdpa) and with
  them (ours: return_attention=True; transformers: eager + output_attentions=True);
* greedy decoding of N new tokens (default 64) after a 16-token prompt: our `generate_tokens`
  against `generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)`; ours again with the
  per-step attention rows the service streams; on CUDA also our decode loop replaying the
  captured step (`GraphedDecoder`).

The script first checks that both give the same logits and the same greedy tokens. On the CPU
the process CPU time is the steadier figure on a shared machine (one thread); on CUDA the
wall clock around work that ends in a device synchronisation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

from bench_model import paired_ms  # noqa: E402

from attnlens.model.checkpoint import load_checkpoint  # noqa: E402
from attnlens.model.cuda_graphs import GraphedDecoder  # noqa: E402
from attnlens.model.decoding import RowSampler, SamplingParams, decode_step, generate_tokens  # noqa: E402
from attnlens.model.interop.convert import import_checkpoint  # noqa: E402
from attnlens.model.tokenizer import Tokenizer  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# the shapes a run can take (--preset); --layers and --vocab override the preset's
PRESETS = {
    "default": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                    num_key_value_heads=4, vocab_size=32000, rope_theta=500000.0),
    # SmolLM2-135M-Instruct's shape (the packaged default model), for a device its file cannot reach
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0),
}


def llama_dir(out: Path, *, layers: int | None = None, vocab: int | None = None, preset: str = "default",
              seed: int = 0) -> Path:
    """A transformers Llama directory with random weights (norms and biases-free projections a
    little away from their init, like a trained model) and a small byte-level tokenizer."""
    import transformers

    shape = dict(PRESETS[preset])
    theta = shape.pop("rope_theta")
    shape["num_hidden_layers"] = layers or shape["num_hidden_layers"]
    shape["vocab_size"] = vocab or shape["vocab_size"]
    config = transformers.LlamaConfig(
        **shape, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": theta}, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.02))
    model.save_pretrained(out)
    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer\n"
    Tokenizer.train([text] * 50, vocab_size=512).save(out / "tokenizer.json")
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed_s(fn, device: str, reps: int, warmup: int = 2) -> float:
    """Median wall seconds of fn() with the device synchronised around it."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: CPUs are shared)")
    p.add_argument("--preset", default="default", choices=sorted(PRESETS),
                   help="default: about 100M parameters; smollm2: SmolLM2-135M's shape, random weights")
    p.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    p.add_argument("--vocab", type=int, help="vocabulary size (default: the preset's)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens in the forward benchmark")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens to decode greedily")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)

    import transformers
    from transformers import LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    device, dtype = args.device, DTYPES[args.dtype]
    tmp = tempfile.TemporaryDirectory()
    src = llama_dir(Path(tmp.name) / "hf", layers=args.layers, vocab=args.vocab, preset=args.preset)
    t0 = time.perf_counter()
    ours_dir, _ = import_checkpoint(src, Path(tmp.name) / "ours")
    import_s = time.perf_counter() - t0

    ours = load_checkpoint(ours_dir, device=device, dtype=dtype).model
    hf_sdpa = LlamaForCausalLM.from_pretrained(src, attn_implementation="sdpa", dtype=dtype).to(device).eval()
    hf_eager = LlamaForCausalLM.from_pretrained(src, attn_implementation="eager", dtype=dtype).to(device).eval()
    cfg = ours.config

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (1, args.seq_len), generator=g).to(device)
    prompt = ids[:, :args.prompt_len]
    n_new = args.new_tokens
    with torch.inference_mode():
        diff = (ours(ids).logits.float() - hf_sdpa(ids).logits.float()).abs().max().item()

    greedy = SamplingParams(temperature=0)
    results: dict[str, list[int]] = {}

    def ours_forward():
        with torch.inference_mode():
            ours(ids)

    def ours_forward_attn():
        with torch.inference_mode():
            ours(ids, return_attention=True)

    def hf_forward():
        with torch.inference_mode():
            hf_sdpa(ids)

    def hf_forward_attn():
        with torch.inference_mode():
            hf_eager(ids, output_attentions=True)

    def ours_decode():
        results["ours"] = [t.id for t in generate_tokens(ours, prompt[0].tolist(), n_new, greedy)]

    def ours_decode_attn():
        for _ in generate_tokens(ours, prompt[0].tolist(), n_new, greedy, return_attention=True):
            pass

    def hf_decode():
        with torch.inference_mode():
            out = hf_sdpa.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                   max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=0)
        results["hf"] = out[0, args.prompt_len:].tolist()

    kw = dict(warmup=args.warmup, reps=args.reps)
    if device == "cpu":  # paired: ours and transformers take turns; wall and process-CPU medians
        fwd, hf_fwd = paired_ms([ours_forward, hf_forward], **kw)
        fwd_attn, hf_fwd_attn = paired_ms([ours_forward_attn, hf_forward_attn], **kw)
        dec, dec_attn, hf_dec = paired_ms([ours_decode, ours_decode_attn, hf_decode], **kw)
    else:  # wall clock with the device synchronised; cpu columns repeat it
        def both(fn):
            s = timed_s(fn, device, args.reps, args.warmup) * 1000
            return s, s

        fwd, hf_fwd, fwd_attn, hf_fwd_attn = (both(f) for f in (ours_forward, hf_forward, ours_forward_attn,
                                                                  hf_forward_attn))
        dec, dec_attn, hf_dec = (both(f) for f in (ours_decode, ours_decode_attn, hf_decode))
    rows = [(f"forward T={args.seq_len}", fwd, hf_fwd), (f"forward T={args.seq_len} + attention", fwd_attn, hf_fwd_attn),
            (f"greedy decode {n_new} tok", dec, hf_dec)]

    graphed_ms = None
    if device == "cuda":
        cache = ours.new_kv_cache(1)
        graphs = GraphedDecoder(ours, cache, buckets=(1,))
        sampler = [RowSampler(greedy)]

        @torch.inference_mode()
        def graphed():
            cache.reset()
            token = decode_step(ours, cache, prompt, sampler).tokens[0]
            for _ in range(n_new - 1):
                token = decode_step(ours, cache, torch.tensor([[token.id]]), sampler, graphs=graphs).tokens[0]

        graphed_ms = timed_s(graphed, device, args.reps, args.warmup) * 1000

    n_params = ours.num_parameters()
    where = torch.cuda.get_device_name() if device == "cuda" else f"{torch.get_num_threads()} CPU thread(s)"
    print(f"model     Llama-shaped, random weights: {cfg.n_layers} layers x {cfg.n_heads} query / {cfg.kv_heads} "
          f"key-value heads, d_model {cfg.d_model}, SwiGLU d_ff {cfg.d_ff}, vocab {cfg.vocab_size} (tied), "
          f"{n_params / 1e6:.1f}M parameters; import-hf took {import_s:.1f} s")
    print(f"runtime   torch {torch.__version__}, transformers {transformers.__version__}, {where}, {args.dtype}, "
          f"median of {args.reps} after {args.warmup} warm-up(s)")
    print(f"parity    max |logits diff| = {diff:.2e}; greedy tokens identical: {results['ours'] == results['hf']}")
    print()
    print(f"{'case':<27} {'attnlens':>18} {'transformers':>18} {'speed-up':>15}")
    print(f"{'':<27} {'wall ms':>9}{'cpu ms':>9} {'wall ms':>9}{'cpu ms':>9} {'wall':>7}{'cpu':>8}")
    for name, (aw, ac), (bw, bc) in rows:
        print(f"{name:<27} {aw:>9.1f}{ac:>9.1f} {bw:>9.1f}{bc:>9.1f} {bw / aw:>6.2f}x{bc / ac:>7.2f}x")
    (hw, hc) = rows[2][2]
    aw, ac = dec_attn
    print(f"{'greedy decode + attention':<27} {aw:>9.1f}{ac:>9.1f} {'-':>9}{'-':>9} {hw / aw:>6.2f}x{hc / ac:>7.2f}x")
    if graphed_ms is not None:
        print(f"{'greedy decode, CUDA graphs':<27} {graphed_ms:>9.1f}{'-':>9} {'-':>9}{'-':>9} {hw / graphed_ms:>6.2f}x")
    print()
    dw, dc = rows[2][1]
    basis = "cpu time" if device == "cpu" else "wall"
    ours_t, hf_t = (dc, hc) if device == "cpu" else (dw, hw)
    print(f"decode throughput ({basis}): attnlens {n_new / ours_t * 1000:.1f} tok/s, transformers generate() "
          f"{n_new / hf_t * 1000:.1f} tok/s")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
