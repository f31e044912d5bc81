"""Helpers the service tests share: reading server-sent events, the reference tokens a
generation must produce, and waiting on an engine's generations."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Iterable, Iterator

import httpx
import pytest
import torch

from attnlens.model import SamplingParams, generate_tokens

# Device parameters for tests that run on the CPU and, where there is one, on a CUDA device.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device on this machine")])]

REPO_ROOT = Path(__file__).resolve().parent.parent

TINY_TEXT = (
    "To be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer\n"
    "The slings and arrows of outrageous fortune,\n"
    "Or to take arms against a sea of troubles\n"
    "And by opposing end them. To die—to sleep,\n"
    "No more; and by a sleep to say we end\n"
    "Café naïve résumé — 東京 and emoji 😀🎭 too.\n"
)


def make_tiny_checkpoint(path: Path, *, seed: int = 0, **overrides) -> Path:
    """Write a small random checkpoint (byte-level BPE on TINY_TEXT) to `path`."""
    from attnlens.model import ModelConfig, Tokenizer, Transformer, save_checkpoint

    tok = Tokenizer.train([TINY_TEXT] * 4, vocab_size=300)
    fields = dict(
        vocab_size=tok.vocab_size,
        context_length=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(**fields))
    save_checkpoint(path, model, tok)
    return path



def sharp_checkpoint(root: Path, *, seed: int, **overrides) -> Path:
    """A random GPT-2-shaped checkpoint in root/"ours" whose heads attend sharply (query/key weights
    scaled up), so head scores are varied and far from uniform: what head-score tests compare."""
    from attnlens.model import load_checkpoint, save_checkpoint

    make_tiny_checkpoint(root / "seed", seed=seed, **overrides)
    ck = load_checkpoint(root / "seed")
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in ck.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        for block in ck.model.blocks:
            block.attn.qkv.weight.mul_(8)
    save_checkpoint(root / "ours", ck.model, ck.tokenizer)
    return root / "ours"


def never_eos_checkpoint(path: Path, *, context_length: int) -> Path:
    """The tiny random model, edited so that EOS is never sampled: long generations then
    really run until cancelled. With the final LayerNorm's weight all ones, the normalised
    features sum to zero, so an EOS row of -5 * ones scores exactly -5 * sum(ln_f.bias)."""
    from attnlens.model import load_checkpoint, save_checkpoint

    make_tiny_checkpoint(path, context_length=context_length, tie_embeddings=False)
    ck = load_checkpoint(path)
    with torch.no_grad():
        ck.model.ln_f.weight.fill_(1.0)
        ck.model.ln_f.bias.fill_(0.1)
        ck.model.lm_head.weight[ck.tokenizer.eos_id].fill_(-5.0)  # logit -16 at every position
    save_checkpoint(path, ck.model, ck.tokenizer)
    return path

MAX_PROMPT = 40  # the `client` fixture's ATTNLENS_MAX_PROMPT_TOKENS
MAX_NEW = 60  # the `client` fixture's ATTNLENS_MAX_NEW_TOKENS


def sse_events(lines: Iterable[str]) -> Iterator[tuple[str | None, str]]:
    """(event, data) pairs from server-sent event lines (`event` None when the event has no name)."""
    name, data = None, []
    for line in lines:
        if line == "":
            if data:
                yield name, "\n".join(data)
            name, data = None, []
        elif line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data.append(line[len("data: "):])
    if data:
        yield name, "\n".join(data)


def parse_sse(text: str) -> list[tuple[str | None, str]]:
    """(event, data) pairs of a whole server-sent events body."""
    return list(sse_events(text.split("\n")))


def data_chunks(text: str) -> list[str]:
    """The `data:` payloads of a server-sent events body (OpenAI streams have no event names)."""
    return [data for _, data in parse_sse(text)]


def reference_tokens(ckpt, prompt: str | list[int], n: int, *, n_logprobs: int = 0, return_attention: bool = False,
                     **sampling):
    """What the model generates for `prompt` alone (model.generate_tokens), up to its EOS (excluded)."""
    ids = ckpt.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    toks = list(generate_tokens(ckpt.model, ids, n, SamplingParams(**sampling), n_logprobs=n_logprobs,
                                return_attention=return_attention))
    eos = ckpt.tokenizer.eos_id
    out = []
    for t in toks:
        if t.id == eos:
            break
        out.append(t)
    return out


def reference_ids(ckpt, prompt: str | list[int], n: int, **sampling) -> list[int]:
    return [t.id for t in reference_tokens(ckpt, prompt, n, **sampling)]


def run_async(coroutine):
    """asyncio.run(coroutine) on a thread of its own, so it works even when this thread already
    has a running event loop (the browser tests' session-long Playwright keeps one)."""
    import threading

    result: dict = {}

    def target():
        try:
            result["value"] = asyncio.run(coroutine)
        except BaseException as e:  # re-raised in the caller
            result["error"] = e

    thread = threading.Thread(target=target, name="test-event-loop")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


async def drain(generation):
    """(token ids, last event) of an engine generation; last is a DoneEvent or ErrorEvent."""
    from attnlens.app.engine.outputs import TokenEvent

    tokens, last = [], None
    async for event in generation.events():
        if isinstance(event, TokenEvent):
            tokens.append(event.id)
        else:
            last = event
    return tokens, last


class HeldModel:
    """The real model, but from its `hold_at`-th forward on each one waits until `release` is set
    or `give_up()` says so (e.g. once the engine is closing)."""

    def __init__(self, model, hold_at: int, give_up=lambda: False):
        self._model = model
        self.hold_at = hold_at
        self.give_up = give_up
        self.calls = 0
        self.held = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, ids, **kw):
        self.calls += 1
        if self.calls >= self.hold_at:
            self.held.set()
            while not self.release.wait(0.01) and not self.give_up():
                pass
        return self._model(ids, **kw)


@torch.no_grad()
def copy_attention_into_torch(ours, theirs) -> None:
    """Copy our MultiHeadAttention's weights into a torch nn.MultiheadAttention (same layout:
    qkv rows q|k|v = in_proj, proj = out_proj), for parity tests against PyTorch."""
    theirs.in_proj_weight.copy_(ours.qkv.weight)
    theirs.in_proj_bias.copy_(ours.qkv.bias)
    theirs.out_proj.weight.copy_(ours.proj.weight)
    theirs.out_proj.bias.copy_(ours.proj.bias)



def head_slice_prehook(head: int, d_head: int, how: str):
    """A forward pre-hook for a module whose input is the heads' outputs side by side ([B, T, H*D],
    e.g. transformers' GPT-2 attn.c_proj or BERT's attention.output.dense): head `head`'s slice set
    to 0 ("zero") or to its mean over the sequence's positions ("mean"), TransformerLens's ablations
    written out independently of attnlens.model.hooks."""
    lo, hi = head * d_head, (head + 1) * d_head

    def hook(module, args):
        (x,) = args
        x = x.clone()
        if how == "zero":
            x[..., lo:hi] = 0
        else:
            x[..., lo:hi] = x[..., lo:hi].mean(dim=1, keepdim=True)
        return (x,)

    return hook


def small_config_model(seed: int = 0, **overrides):
    """A small random decoder built from a config alone (no tokenizer): e.g. Llama-style GQA + rotary."""
    from attnlens.model import ModelConfig, Transformer

    fields = dict(vocab_size=97, context_length=32, d_model=32, n_layers=2, n_heads=4, d_ff=64)
    fields.update(overrides)
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**fields)).eval()


def assert_json_close(a, b, abs_tol: float = 1e-5, path: str = "") -> None:
    """Two JSON values equal, floats within abs_tol (nested dicts and lists)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_json_close(a[k], b[k], abs_tol, f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_json_close(x, y, abs_tol, f"{path}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, abs=abs_tol), path
    else:
        assert a == b, path



class RecordingTransport(httpx.HTTPTransport):
    """An httpx transport that keeps the JSON body of every request sent with one (what a client
    sends): attnlens.Client(url, transport=RecordingTransport()), then `.bodies`."""

    def __init__(self):
        super().__init__()
        self.bodies: list[dict] = []

    def handle_request(self, request):
        if request.content:
            self.bodies.append(json.loads(request.content))
        return super().handle_request(request)
