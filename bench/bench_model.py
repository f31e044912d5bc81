"""Benchmark attnlens' transformer against `transformers` GPT-2 on identical weights (CPU).

    .venv/bin/python bench/bench_model.py                 # checkpoints/default, else a random default-sized model
    .venv/bin/python bench/bench_model.py --model DIR     # any GPT-2-shaped attnlens checkpoint
    .venv/bin/python bench/bench_model.py --threads 2 --reps 7

Our checkpoint is exported with `model.interop.hf.export_hf` and loaded with
`transformers.GPT2LMHeadModel.from_pretrained`, in this same process. Timed:

* forward over T tokens (default 256), without attention maps (ours: SDPA, transformers: sdpa)
  and with them (ours: return_attention=True, transformers: eager + output_attentions=True);
* greedy decoding of N new tokens (default 128): our `generate_tokens` loop against
  `GPT2LMHeadModel.generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)`;
  also ours with per-step attention maps (what the service streams).

Each case gets warm-up runs, then ours and transformers take turns for several
repetitions; the medians of wall-clock and of process CPU time are reported.
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

from attnlens.model.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from attnlens.model.config import ModelConfig  # noqa: E402
from attnlens.model.decoding import SamplingParams, generate_tokens  # noqa: E402
from attnlens.model.families.decoder import Transformer  # noqa: E402
from attnlens.model.interop.hf import export_hf  # noqa: E402
from attnlens.model.tokenizer import Tokenizer  # noqa: E402

DEFAULT_MODEL = REPO_ROOT / "checkpoints" / "default"
# The bundled default model's shape (configs/default.toml).
DEFAULT_CONFIG = dict(vocab_size=4096, context_length=256, d_model=256, n_layers=4, n_heads=8, d_ff=1024)


def random_checkpoint(out: Path, seed: int = 0, *, shape: dict | None = None, tokenizer: Tokenizer | None = None) -> Path:
    """A GPT-2-shaped checkpoint with random weights: the default model's shape (for when none
    is trained yet) unless `shape` says otherwise, and a small tokenizer unless one is given."""
    if tokenizer is None:
        text = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer\n"
        tokenizer = Tokenizer.train([text] * 50, vocab_size=512)
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**(shape or DEFAULT_CONFIG)))
    with torch.no_grad():  # LayerNorms and biases away from their init, like a trained model
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return save_checkpoint(out, model, tokenizer)


def in_process_client(model_dir: Path):
    """The service in this process (TestClient; the model on a worker thread, no engine process),
    started: the caller closes it (`with in_process_client(d) as client:`)."""
    from fastapi.testclient import TestClient

    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings

    return TestClient(create_app(Settings(model=model_dir, device="cpu", engine_process=False, warmup=False)))


def paired_ms(fns, *, warmup: int, reps: int) -> list[tuple[float, float]]:
    """Median wall-clock and process-CPU milliseconds of each function in `fns`.

    The functions take turns in every repetition, so a burst of load from another
    process on a shared machine hits them alike. With one thread, process CPU time is
    the cleaner measure of the work itself; the wall clock also counts time other
    processes held the CPU.
    """
    for _ in range(warmup):
        for fn in fns:
            fn()
    wall: list[list[float]] = [[] for _ in fns]
    cpu: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[i].append((time.perf_counter() - w0) * 1000)
            cpu[i].append((time.process_time() - c0) * 1000)
    return [(statistics.median(w), statistics.median(c)) for w, c in zip(wall, cpu)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="attnlens checkpoint (default: checkpoints/default if present)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: CPUs are shared)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens in the forward benchmark")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens to decode greedily")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens before decoding")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)

    import transformers
    from transformers import GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    if args.model:
        src = Path(args.model)
    elif (DEFAULT_MODEL / "model.safetensors").is_file():
        src = DEFAULT_MODEL
    else:
        src = random_checkpoint(Path(tmp.name) / "random")
    hf_dir = export_hf(src, Path(tmp.name) / "hf")

    ours = load_checkpoint(src).model.eval()
    cfg = ours.config
    hf_sdpa = GPT2LMHeadModel.from_pretrained(hf_dir, attn_implementation="sdpa").eval()
    hf_eager = GPT2LMHeadModel.from_pretrained(hf_dir, attn_implementation="eager").eval()

    T = min(args.seq_len, cfg.context_length)
    prompt_len = min(args.prompt_len, cfg.context_length - args.new_tokens)
    if prompt_len < 1:
        p.error(f"--new-tokens {args.new_tokens} does not fit the context length {cfg.context_length}")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)
    prompt = ids[:, :prompt_len]
    n_new = args.new_tokens

    # Same weights, same numbers (a sanity check before timing anything).
    with torch.inference_mode():
        diff = (ours(ids).logits - hf_sdpa(ids).logits).abs().max().item()

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

    greedy = SamplingParams(temperature=0)
    results: dict[str, list[int]] = {}

    def ours_decode():
        results["ours"] = [t.id for t in generate_tokens(ours, prompt[0].tolist(), n_new, greedy)]

    def ours_decode_attn():
        for _ in generate_tokens(ours, prompt[0].tolist(), n_new, greedy, return_attention=True):
            pass

    def hf_decode():
        with torch.inference_mode():
            out = hf_sdpa.generate(prompt, do_sample=False, max_new_tokens=n_new, min_new_tokens=n_new,
                                   pad_token_id=hf_sdpa.config.eos_token_id)  # fmt: skip
        results["hf"] = out[0, prompt_len:].tolist()

    kw = dict(warmup=args.warmup, reps=args.reps)
    fwd, hf_fwd = paired_ms([ours_forward, hf_forward], **kw)
    fwd_attn, hf_fwd_attn = paired_ms([ours_forward_attn, hf_forward_attn], **kw)
    dec, dec_attn, hf_dec = paired_ms([ours_decode, ours_decode_attn, hf_decode], **kw)
    rows = [
        (f"forward T={T}", fwd, hf_fwd),
        (f"forward T={T} + attention", fwd_attn, hf_fwd_attn),
        (f"greedy decode {n_new} tok", dec, hf_dec),
    ]
    ours_attn_decode = dec_attn

    n_params = ours.num_parameters()
    print(f"model     {src if src != Path(tmp.name) / 'random' else 'random weights'}: {cfg.n_layers} layers x "
          f"{cfg.n_heads} heads, d_model {cfg.d_model}, d_ff {cfg.d_ff}, vocab {cfg.vocab_size}, "
          f"context {cfg.context_length}, {n_params / 1e6:.2f}M parameters")  # fmt: skip
    print(f"runtime   torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} thread(s), median of {args.reps} after {args.warmup} warm-up(s)")
    print(f"parity    max |logits diff| = {diff:.2e}; greedy tokens identical: "
          f"{results['ours'] == results['hf']}")  # fmt: skip
    print()
    print(f"{'case':<27} {'attnlens':>18} {'transformers':>18} {'speed-up':>15}")
    print(f"{'':<27} {'wall ms':>9}{'cpu ms':>9} {'wall ms':>9}{'cpu ms':>9} {'wall':>7}{'cpu':>8}")
    for name, (aw, ac), (bw, bc) in rows:
        print(f"{name:<27} {aw:>9.1f}{ac:>9.1f} {bw:>9.1f}{bc:>9.1f} {bw / aw:>6.2f}x{bc / ac:>7.2f}x")
    (_, dc), (hw, hc) = rows[2][1], rows[2][2]
    aw, ac = ours_attn_decode
    print(f"{'greedy decode + attention':<27} {aw:>9.1f}{ac:>9.1f} {'-':>9}{'-':>9} {hw / aw:>6.2f}x{hc / ac:>7.2f}x")
    print()
    print(f"decode throughput (cpu time): attnlens {n_new / dc * 1000:.0f} tok/s, "
          f"transformers generate() {n_new / hc * 1000:.0f} tok/s")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
