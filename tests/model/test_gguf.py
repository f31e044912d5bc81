"""GGUF files as an import source, against transformers' own GGUF loader on the same file
(`from_pretrained(dir, gguf_file=...)`, which has its own dequantizer and its own Q/K
un-permutation): every weight, the logits, the tokenizer and the chat template's ids.

The files are small random models written with the `gguf` package's writer the way llama.cpp's
converter writes them (tests/helpers.py write_gguf): llama, qwen2 and a llama-architecture
Mistral, in every block format the reader dequantizes.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from helpers import write_gguf  # noqa: E402

from attnlens.model import load_checkpoint  # noqa: E402
from attnlens.model.checkpoint import CheckpointError  # noqa: E402
from attnlens.model.interop.architectures import ARCHITECTURES  # noqa: E402
from attnlens.model.interop.convert import import_checkpoint  # noqa: E402

AWKWARD = ["12345 apples and 3.14159", " 1 2 3 1999", "héllo   wörld\n\n  x", "日本語 🤗 emoji 🎭",
           "def f(x):\n    return x**2  # code\n", "<|im_start|>user\nhi<|im_end|>", "\t\ttabs  and   spaces   ",
           "don't it's WE'LL", "the the thee"]

# (arch, general.name, block format, tied head, q/k/v biases)
CASES = {
    "llama-q8_0": ("llama", "tiny", "Q8_0", True, False),
    "llama-q4_0-untied": ("llama", "tiny", "Q4_0", False, False),
    "llama-q4_1": ("llama", "tiny", "Q4_1", True, False),
    "llama-f16": ("llama", "tiny", "F16", True, False),
    "llama-bf16": ("llama", "tiny", "BF16", True, False),
    "llama-f32": ("llama", "tiny", "F32", True, False),
    "qwen2-q5_0": ("qwen2", "tiny", "Q5_0", True, True),
    "qwen2-q5_1-untied": ("qwen2", "tiny", "Q5_1", False, True),
    "mistral-q8_0": ("llama", "tiny-mistral", "Q8_0", False, False),
}


def transformers_gguf(path):
    """transformers' model (float32) and tokenizer read from the GGUF file itself."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tok


def theirs_from_ours(ckpt) -> dict[str, torch.Tensor]:
    """Our weights under transformers' names, by the architecture's own rules (split q|k|v, gate|up)."""
    arch = next(a for a in ARCHITECTURES if a.hf_class == ckpt.config.architecture)
    ours = {k: v.detach().float() for k, v in ckpt.model.state_dict().items()}
    return {name: t for rule in arch.tensors(ckpt.config)
            for name, t in zip(rule.theirs, rule.split(ours[rule.ours]))}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    arch, name, qtype, tied, bias = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    path = write_gguf(root / "model.gguf", arch=arch, name=name, qtype=qtype, tied=tied, qkv_bias=bias, seed=len(name))
    import_checkpoint(path, root / "ckpt")
    return request.param, load_checkpoint(root / "ckpt"), *transformers_gguf(path)


def test_every_weight_and_the_logits_equal_transformers_gguf_loader(case):
    key, ckpt, hf, _ = case
    want = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[key.split("-")[0]]
    assert ckpt.config.architecture == want
    assert ckpt.config.tie_embeddings == ("untied" not in key and key != "mistral-q8_0")
    theirs = {k: v.float() for k, v in hf.state_dict().items()}
    mine = theirs_from_ours(ckpt)
    if ckpt.config.tie_embeddings:
        theirs.pop("lm_head.weight", None)
    assert set(mine) == set(theirs)
    for name, t in mine.items():
        torch.testing.assert_close(t, theirs[name], atol=0, rtol=0, msg=name)
    ids = torch.tensor([[5, 40, 71, 100, 7, 260, 3, 88, 120, 9, 33, 250]])
    with torch.no_grad():
        ours = ckpt.model(ids).logits
        ref = hf(ids).logits
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_tokenizer_and_chat_template_ids_equal_transformers(case):
    _, ckpt, _, hf_tok = case
    tok = ckpt.tokenizer
    for text in AWKWARD:
        assert tok.encode(text) == hf_tok(text, add_special_tokens=False)["input_ids"], text
        assert tok.decode(tok.encode(text)) == text
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.add_bos is False and 2 in tok.eos_ids
    from attnlens.app.serving.prompts import render_chat

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is 1st?"}]
    text = render_chat(tok.chat_template, messages, tok.template_tokens)
    want = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert tok.encode(text) == list(want)


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_weights_equal_transformers_dequantizer(qtype, tmp_path):
    """The K-quants (256-value super-blocks) from random blocks: `gguf` cannot quantize them, so the
    blocks are random bytes, read by `gguf.quants` here and by transformers' own dequantizer there."""
    path = write_gguf(tmp_path / "k.gguf", qtype=qtype, d_model=256, n_heads=4, n_kv=2, d_ff=512, random_blocks=True)
    import_checkpoint(path, tmp_path / "ckpt")
    ckpt = load_checkpoint(tmp_path / "ckpt")
    hf, _ = transformers_gguf(path)
    theirs = hf.state_dict()
    for name, t in theirs_from_ours(ckpt).items():
        torch.testing.assert_close(t, theirs[name].float(), atol=0, rtol=0, msg=name)


@pytest.fixture
def good(tmp_path):
    return write_gguf(tmp_path / "good.gguf")


def _refusal(src, tmp_path) -> str:
    with pytest.raises(CheckpointError) as e:
        import_checkpoint(src, tmp_path / "out")
    return str(e.value)


def test_bad_files_get_one_clear_error_naming_the_problem(good, tmp_path):
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    assert "not a GGUF file" in _refusal(wrong, tmp_path)

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert "truncated or corrupt" in _refusal(cut, tmp_path)

    assert "does not exist" in _refusal(tmp_path / "absent.gguf", tmp_path)

    falcon = write_gguf(tmp_path / "falcon.gguf", arch="falcon")
    assert "GGUF architecture 'falcon' is not supported" in _refusal(falcon, tmp_path)

    missing = write_gguf(tmp_path / "missing.gguf", skip=("blk.1.ffn_up.weight",))
    assert "missing tensor(s) model.layers.1.mlp.up_proj.weight" in _refusal(missing, tmp_path)

    iq = write_gguf(tmp_path / "iq.gguf", qtype="IQ4_NL", random_blocks=True)
    assert "quantized as IQ4_NL, which is not supported" in _refusal(iq, tmp_path)

    other_pre = write_gguf(tmp_path / "pre.gguf", pre="chatglm-bpe")
    assert "pre-tokenizer 'chatglm-bpe' is not supported" in _refusal(other_pre, tmp_path)


def test_cli_imports_a_gguf_file_and_refuses_a_bad_one_in_one_line(good, tmp_path):
    run = [sys.executable, "-m", "attnlens.app.cli", "import-hf", "--out", str(tmp_path / "ckpt")]
    ok = subprocess.run(run + ["--src", str(good), "--context-length", "64"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "Llama" in ok.stdout
    assert load_checkpoint(tmp_path / "ckpt").config.context_length == 64
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:300])
    bad = subprocess.run(run + ["--src", str(cut)], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


DIGIT_MERGES = [("1", "2"), ("12", "3"), ("Ġ", "1"), ("Ġ", "w"), ("Ġw", "o")]


@pytest.mark.parametrize("pre, want", [
    ("smollm", [["1", "2", "3", "4"], ["Ġ", "1"]]),  # every digit alone, then GPT-2's split
    ("qwen2", [["1", "2", "3", "4"], ["Ġ", "1"]]),  # Qwen2's regex: \p{N} one at a time
    ("llama-bpe", [["123", "4"], ["Ġ", "1"]]),  # Llama 3's: numbers in runs of up to three
    ("gpt2", [["123", "4"], ["Ġ1"]]),  # GPT-2's regex keeps " 1234" whole
])
def test_each_pre_tokenizer_splits_numbers_as_llama_cpp_does(pre, want, tmp_path):
    """A vocabulary that *can* merge digits ("12", "123", "Ġ1"), so the split before the merges shows:
    the pieces of "1234" and of " 1" under each `tokenizer.ggml.pre` (llama.cpp's llama-vocab.cpp)."""
    from attnlens.model.interop.gguf_file import metadata, open_reader
    from attnlens.model.interop.gguf_tokenizer import tokenizer_from_metadata

    path = write_gguf(tmp_path / "digits.gguf", pre=pre, merges=DIGIT_MERGES)
    tok = tokenizer_from_metadata(metadata(open_reader(path)), path)
    pieces = [[tok.backend.id_to_token(i) for i in tok.encode(text)] for text in ("1234", " 1")]
    assert pieces == want
