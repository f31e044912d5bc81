"""Packed weights (model/packed/): a GGUF file's Q4_0, Q4_1 and Q8_0 blocks kept as they are and
multiplied with directly, against the same file dequantized to float32 (what every other mode
serves; itself proven against transformers' GGUF loader in test_gguf.py and test_smollm2.py).

The bound: on SmolLM2 (three prompts, prefill and 48 greedy tokens) packed and float32 logits
differ by at most 1.3e-4 (logits up to 36), attention probabilities by at most 5e-6: the products
are the dequantized matrix's summed in another order. Tested at LOGIT_BOUND and the issue's 2e-3
for maps. Greedy text must be equal, token for token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import write_gguf

from attnlens.model import SamplingParams, generate_tokens, load_checkpoint
from attnlens.model.checkpoint import CheckpointError
from attnlens.model.interop.convert import import_checkpoint
from attnlens.model.packed import kernel
from attnlens.model.packed.loading import PACKED_FILE, describe
from attnlens.model.packed.modules import PackedEmbedding, PackedLinear, PackedMatrix

FORMATS = ["Q4_0", "Q4_1", "Q8_0"]
LOGIT_BOUND = 5e-4  # measured at most 1.3e-4 on SmolLM2 (module docstring)
MAP_BOUND = 2e-3

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(not kernel.available()[0], reason=f"packed kernel: {kernel.available()[1]}")


def quantized(fmt: str, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """Random weights quantized by gguf into `fmt`: (the blocks, gguf's own dequantization)."""
    qt = gguf.GGMLQuantizationType[fmt]
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    blocks = gguf.quants.quantize(values, qt)
    return blocks, torch.from_numpy(np.array(gguf.quants.dequantize(blocks, qt), dtype=np.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_dequantize_exactly_as_gguf_and_multiply_within_rounding(fmt):
    blocks, reference = quantized(fmt, 300, 576)
    packed = PackedMatrix(torch.from_numpy(blocks.copy()), fmt, 576)
    assert torch.equal(packed.dequantize(), reference)
    rows = torch.tensor([299, 0, 7, 7])
    assert torch.equal(packed.dequantize(rows), reference[rows])
    w64 = reference.double()
    for m in (1, 2, 3, 4, 5, 16, 17, 40, 64, 65, 80):  # the kernel (up to 64 rows, in tiles), then BLAS tiles
        x = torch.randn(m, 576)
        got, want = packed.matmul(x).double(), x.double() @ w64.T
        scale = x.double().abs() @ w64.abs().T  # what the sums' rounding can reach
        assert ((got - want).abs() <= 1e-6 * scale + 1e-6).all(), (fmt, m)
    x3 = torch.randn(2, 3, 576)  # any leading shape
    assert packed.matmul(x3).shape == (2, 3, 300)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_gets_the_same_bits_alone_or_in_a_batch(fmt):
    """A decode step's row summed with up to 63 others (the kernel's tiles) gets exactly the bits it
    gets alone: a stream's tokens do not depend on how many streams share its steps. Odd block
    counts (K = 608: 19 blocks) included."""
    for cols in (576, 608):
        blocks, _ = quantized(fmt, 130, cols, seed=1)
        packed = PackedMatrix(torch.from_numpy(blocks.copy()), fmt, cols)
        x = torch.randn(64, cols)
        alone = torch.cat([packed.matmul(x[i:i + 1]) for i in range(64)])
        for m in (2, 3, 4, 5, 8, 9, 13, 16, 17, 25, 40, 64):
            assert torch.equal(packed.matmul(x[:m]), alone[:m]), (fmt, cols, m)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_kernel_is_the_float32_product_of_the_dequantized_matrix_bit_for_bit(fmt):
    """Each block is widened to gguf's float32 values and summed as float_matvec.c sums a float32
    row (model/native/float_dots.h): the packed product is float32's on the dequantized matrix,
    bit for bit, at any rows (so a packed decode step is a float32 one)."""
    from attnlens.model.native import library as native

    blocks, reference = quantized(fmt, 70, 608, seed=2)
    packed = PackedMatrix(torch.from_numpy(blocks.copy()), fmt, 608)
    for m in (1, 2, 7, 9, 33, 64):
        x = torch.randn(m, 608)
        want = torch.empty(m, 70)
        native.load().float_matmul_few(x.data_ptr(), m, 608, reference.data_ptr(), 70, 0, want.data_ptr())
        assert torch.equal(packed.matmul(x), want), (fmt, m)


def test_a_malformed_matrix_or_input_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="Q4_K"):
        PackedMatrix(torch.zeros(4, 144, dtype=torch.uint8), "Q4_K", 256)
    with pytest.raises(ValueError, match=r"needs \(rows, 36\)"):
        PackedMatrix(torch.zeros(4, 40, dtype=torch.uint8), "Q4_0", 64)
    linear = PackedLinear(PackedMatrix(torch.zeros(4, 36, dtype=torch.uint8), "Q4_0", 64))
    with pytest.raises(ValueError, match="float32 inputs on the CPU"):
        linear(torch.zeros(1, 64, dtype=torch.float64))
    embedding = PackedEmbedding(PackedMatrix(torch.zeros(4, 36, dtype=torch.uint8), "Q4_0", 64))
    with pytest.raises(IndexError, match="out of range"):
        embedding(torch.tensor([[4]]))


@pytest.fixture(scope="module", params=[(fmt, tied) for fmt in FORMATS for tied in (True, False)],
                ids=lambda p: f"{p[0]}-{'tied' if p[1] else 'untied'}")
def pair(request, tmp_path_factory):
    """A random llama GGUF file in one block format, imported; loaded in float32 and packed."""
    fmt, tied = request.param
    root = tmp_path_factory.mktemp(f"packed-{fmt}-{tied}")
    out, _ = import_checkpoint(write_gguf(root / "m.gguf", qtype=fmt, tied=tied, d_model=64, d_ff=128), root / "ckpt")
    return load_checkpoint(out), load_checkpoint(out, packed=True), fmt, tied


def test_every_matrix_is_packed_in_the_files_format_and_nothing_else_changes(pair):
    f32, packed, fmt, tied = pair
    n_layers = f32.config.n_layers
    # per layer q|k|v, attention output, gate|up, down; the embedding (a tied head shares it) and an untied head
    assert describe(packed.model) == {fmt: 4 * n_layers + 1 + (0 if tied else 1)}
    assert isinstance(packed.model.tok_emb, PackedEmbedding) and isinstance(packed.model.lm_head, PackedLinear)
    assert (packed.model.lm_head.packed is packed.model.tok_emb.packed) == tied
    assert packed.model.num_parameters() == f32.model.num_parameters()
    assert packed.model.device == torch.device("cpu") and packed.model.dtype == torch.float32
    for name, p in packed.model.named_parameters():  # norms: the float32 file's
        assert torch.equal(p, f32.model.get_parameter(name)), name
    assert torch.equal(packed.model.blocks[0].attn.qkv.weight, f32.model.blocks[0].attn.qkv.weight)


def test_logits_maps_and_greedy_text_agree_with_float32(pair):
    f32, packed, _, _ = pair
    V = f32.config.vocab_size
    for T in (1, 7, 16, 40):  # the kernel's rows, then a prefill's BLAS tiles
        ids = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            a, b = f32.model(ids, return_attention=True), packed.model(ids, return_attention=True)
        assert (a.logits - b.logits).abs().max() <= LOGIT_BOUND
        assert max((x - y).abs().max() for x, y in zip(a.attentions, b.attentions)) <= MAP_BOUND
    for seed in range(3):
        prompt = torch.randint(0, V, (6,), generator=torch.Generator().manual_seed(100 + seed)).tolist()
        a = list(generate_tokens(f32.model, prompt, 24, SamplingParams(temperature=0.0)))
        b = list(generate_tokens(packed.model, prompt, 24, SamplingParams(temperature=0.0)))
        assert [t.id for t in a] == [t.id for t in b]
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b)) <= LOGIT_BOUND


def test_a_folder_without_blocks_loads_in_float32_and_packed_needs_the_cpu(tmp_path):
    f32 = write_gguf(tmp_path / "f32.gguf", qtype="F32")
    out, _ = import_checkpoint(f32, tmp_path / "ckpt")
    assert not (out / PACKED_FILE).exists()
    assert describe(load_checkpoint(out, packed=True).model) == {}
    q = write_gguf(tmp_path / "q.gguf", qtype="Q8_0")
    out, _ = import_checkpoint(q, tmp_path / "ckpt")  # imported again into the same folder: blocks now
    assert (out / PACKED_FILE).is_file()
    with pytest.raises(CheckpointError, match="on the CPU in float32"):
        load_checkpoint(out, packed=True, dtype=torch.bfloat16)
    out, _ = import_checkpoint(f32, tmp_path / "ckpt")  # and again from float32: no stale blocks left
    assert not (out / PACKED_FILE).exists()


def test_k_quant_blocks_are_not_packed(tmp_path):
    """Q4_K (and the other K-quants) are dequantized to float32 as before, with no packed file."""
    path = write_gguf(tmp_path / "k.gguf", qtype="Q4_K", d_model=256, n_heads=4, n_kv=2, d_ff=512, random_blocks=True)
    out, _ = import_checkpoint(path, tmp_path / "ckpt")
    assert not (out / PACKED_FILE).exists()


def test_a_corrupt_packed_file_is_one_clear_error(pair, tmp_path):
    f32 = pair[0]
    folder = tmp_path / "ckpt"
    import shutil

    shutil.copytree(f32.path, folder)
    (folder / PACKED_FILE).write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="packed.safetensors"):
        load_checkpoint(folder, packed=True)


def test_the_service_serves_packed_by_default_on_the_cpu_and_float32_opts_out(tmp_path, caplog):
    from attnlens.model.placement import load_for_serving, resolve_dtype, weights_label

    out, _ = import_checkpoint(write_gguf(tmp_path / "q.gguf", qtype="Q4_1"), tmp_path / "ckpt")
    for setting, packed in (("auto", True), ("packed", True), ("float32", False)):
        ckpt = load_for_serving(out, "cpu", setting)
        assert bool(describe(ckpt.model)) == packed, setting
        shapes = load_for_serving(out, "cpu", setting, engine_process=True)  # the server beside its engine process
        label = "packed: Q4_1 x9" if packed else "float32"  # 2 layers x 4 matrices, the embedding (tied head)
        assert weights_label(ckpt, setting) == weights_label(shapes, setting) == label
    with pytest.raises(RuntimeError, match="CPU only"):
        resolve_dtype("packed", torch.device("cuda"))
    plain, _ = import_checkpoint(write_gguf(tmp_path / "f.gguf", qtype="F32"), tmp_path / "plain")
    with caplog.at_level("WARNING"):
        ckpt = load_for_serving(plain, "cpu", "packed")
        for _ in range(3):  # GET /model asks on every request: the reason is said once, at load
            assert weights_label(ckpt, "packed") == "float32"
        assert weights_label(load_for_serving(plain, "cpu", "packed", engine_process=True), "packed") == "float32"
    assert caplog.text.count("has no packed weights") == 1


# --- SmolLM2, the default model, as its package ships it (Q4_1, a Q8_0 embedding and head) ---------------------
SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):",
                   "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def smollm2_packed(smollm2):
    return load_checkpoint(smollm2.path, packed=True)


@pytest.mark.slow
def test_smollm2_packed_holds_the_files_blocks(smollm2, smollm2_packed):
    assert describe(smollm2_packed.model) == {"Q4_1": 120, "Q8_0": 1}  # 30 x (q|k|v, o, gate|up, down); embedding = head
    blocks = sum(m.blocks.numel() for m in smollm2_packed.model.modules() if isinstance(m, PackedLinear))
    assert blocks < 100e6  # the file is 93 MB; float32 is 540 MB


@pytest.mark.slow
@pytest.mark.parametrize("prompt", SMOLLM2_PROMPTS)
def test_smollm2_packed_agrees_with_float32(smollm2, smollm2_packed, prompt):
    ids = smollm2.tokenizer.encode(prompt)
    with torch.no_grad():
        a = smollm2.model(torch.tensor([ids]), return_attention=True)
        b = smollm2_packed.model(torch.tensor([ids]), return_attention=True)
    assert (a.logits - b.logits).abs().max() <= LOGIT_BOUND
    assert max((x - y).abs().max() for x, y in zip(a.attentions, b.attentions)) <= MAP_BOUND
    ga = list(generate_tokens(smollm2.model, ids, 48, SamplingParams(temperature=0.0)))
    gb = list(generate_tokens(smollm2_packed.model, ids, 48, SamplingParams(temperature=0.0)))
    assert [t.id for t in ga] == [t.id for t in gb]
    assert max(abs(x.logprob - y.logprob) for x, y in zip(ga, gb)) <= LOGIT_BOUND


@pytest.mark.slow
def test_smollm2_served_packed_says_so_and_answers(smollm2, tmp_path):
    import httpx
    from live_server import live_server

    with live_server(smollm2.path, tmp_path, env={"ATTNLENS_DTYPE": "packed"}, timeout=180) as server, \
            httpx.Client(base_url=server.base_url, timeout=120) as client:
        info = client.get("/model").json()
        assert info["weights"] == "packed: Q4_1 x120, Q8_0 x1" and info["dtype"] == "float32"
        r = client.post("/generate", json={"prompt": "The capital of France is", "max_new_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and "Paris" in r.json()["text"]
        r = client.post("/attention", json={"text": "The capital of France is Paris"})
        assert r.status_code == 200, r.text


def test_without_a_compiler_everything_is_served_in_float32_and_says_why(tmp_path, monkeypatch, caplog):
    """No C compiler: packed falls back to float32 with the reason in the log,
    and decoding takes torch's paths (one row through BLAS, attention by batched products)."""
    from attnlens.model.native import library
    from attnlens.model.placement import load_for_serving

    out, _ = import_checkpoint(write_gguf(tmp_path / "q.gguf", qtype="Q8_0"), tmp_path / "ckpt")
    want = list(generate_tokens(load_checkpoint(out).model, [5, 6, 7], 8, SamplingParams(temperature=0.0)))
    monkeypatch.setattr(library, "_library", None)
    monkeypatch.setattr(library, "_failure", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert library.available()[0] is False and "cannot be built or loaded" in library.available()[1]
    with caplog.at_level("WARNING"):
        ckpt = load_for_serving(out, "cpu", "packed")
    assert describe(ckpt.model) == {} and "served in float32, not packed" in caplog.text
    got = list(generate_tokens(ckpt.model, [5, 6, 7], 8, SamplingParams(temperature=0.0)))
    assert [t.id for t in got] == [t.id for t in want]
