"""The weight arena (model/weight_arena.py): a CPU model's large weights moved into one buffer, in
the order a forward reads them, on 2 MB pages. The model must be the same model after it: every
value, every output to the bit, tied weights still one tensor, packed blocks still the module's
buffer, and a checkpoint saved from it reads back equal."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlens.model import load_checkpoint
from attnlens.model.checkpoint import save_checkpoint
from attnlens.model.config import ModelConfig
from attnlens.model.families.decoder import Transformer
from attnlens.model.packed.loading import pack_model
from attnlens.model.packed.modules import PackedEmbedding, PackedLinear
from attnlens.model.weight_arena import MIN_BYTES, gather

LLAMA = dict(vocab_size=512, context_length=64, d_model=128, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=256,
             positional="rotary", activation="silu", bias=False, norm_type="rmsnorm", ffn="gated",
             layer_norm_eps=1e-6)


def model_of(**overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(**{**LLAMA, **overrides})).eval()


def large(net: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in net.named_parameters() if p.numel() * 4 >= MIN_BYTES]


def logits(net: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return net(ids).logits


@pytest.mark.parametrize("tied", [True, False])
def test_gather_keeps_the_model(tied):
    net = model_of(tie_embeddings=tied)
    ids = torch.randint(0, 512, (2, 17))
    before, values = logits(net, ids), {n: p.detach().clone() for n, p in net.named_parameters()}
    params = {n: p for n, p in net.named_parameters()}
    moved = gather(net)
    assert moved >= sum(p.numel() * 4 for _, p in large(net))
    assert {n: p for n, p in net.named_parameters()} == params  # the same Parameter objects
    for n, p in net.named_parameters():
        assert torch.equal(p, values[n]), n
    assert torch.equal(logits(net, ids), before)  # to the bit
    # one storage, each matrix where the one read before it ends (64-byte aligned), in module order
    big = large(net)
    assert len({p.untyped_storage().data_ptr() for _, p in big}) == 1
    ends = [(p.data_ptr(), p.data_ptr() + p.numel() * 4) for _, p in big]
    for (_, end), (start, _) in zip(ends, ends[1:]):
        assert start == -(-end // 64) * 64
    assert [n for n, _ in big][1:4] == ["blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.0.ffn.fc.weight"]
    assert (net.lm_head.weight is net.tok_emb.weight) == tied
    # small tensors (norms) stay where they were
    assert net.blocks[0].ln1.weight.untyped_storage().data_ptr() != big[0][1].untyped_storage().data_ptr()


def test_gather_without_values_then_a_load_is_the_model():
    """values=False (a load about to overwrite every weight): the same arena, nothing copied, and the
    state loaded into it gives the model's own logits."""
    net, ids = model_of(tie_embeddings=True), torch.randint(0, 512, (2, 17))
    before, state = logits(net, ids), {k: v.clone() for k, v in net.state_dict().items()}
    fresh = model_of(tie_embeddings=True)
    with torch.no_grad():
        fresh.tok_emb.weight.fill_(7.0)  # a mark no arena's memory holds: a copy would carry it
    assert gather(fresh, values=False) == gather(model_of(tie_embeddings=True))
    assert not torch.equal(fresh.tok_emb.weight, torch.full_like(fresh.tok_emb.weight, 7.0))  # nothing copied
    fresh.load_state_dict(state)
    assert len({p.untyped_storage().data_ptr() for _, p in large(fresh)}) == 1
    assert torch.equal(logits(fresh, ids), before)


def test_gather_then_train_and_save(tmp_path: Path, default_checkpoint):
    """A model loaded on the CPU is gathered; it still trains (its parameters are leaves with
    gradients) and saves a checkpoint that loads back equal."""
    ck = load_checkpoint(default_checkpoint)
    net = ck.model
    big = [p for p in net.parameters() if p.numel() * 4 >= MIN_BYTES]
    assert big and len({p.untyped_storage().data_ptr() for p in big}) == 1
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    ids = torch.randint(0, net.config.vocab_size, (2, 8))
    loss = net(ids).logits.float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    save_checkpoint(tmp_path / "saved", net, ck.tokenizer)
    again = load_checkpoint(tmp_path / "saved").model
    for (n, a), (_, b) in zip(net.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


def test_gather_packed_blocks_and_a_tied_head():
    gguf = pytest.importorskip("gguf")
    net = model_of(tie_embeddings=True, d_model=256, d_ff=1024)
    state = {}
    for name, module in net.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and name != "lm_head":
            fmt = "Q8_0" if name == "tok_emb" else "Q4_1"
            blocks = gguf.quants.quantize(module.weight.detach().numpy().astype(np.float32),
                                          gguf.GGMLQuantizationType[fmt])
            state[f"{name}.weight"] = (torch.from_numpy(np.ascontiguousarray(blocks)), fmt)
    pack_model(net, state, tied=True)
    assert isinstance(net.tok_emb, PackedEmbedding) and isinstance(net.lm_head, PackedLinear)
    ids = torch.randint(0, 512, (1, 9))
    before = logits(net, ids)
    gather(net)
    assert torch.equal(logits(net, ids), before)
    packed = [m for m in net.modules() if isinstance(m, (PackedLinear, PackedEmbedding))]
    for m in packed:
        assert m.blocks is m.packed.data  # the buffer is still the matrix's tensor
    assert net.lm_head.blocks.data_ptr() == net.tok_emb.blocks.data_ptr()  # tied: one copy
    big = [m for m in packed if m.blocks.numel() >= MIN_BYTES]
    assert len(big) >= 7 and len({m.blocks.untyped_storage().data_ptr() for m in big}) == 1


def test_smollm2_weights_on_huge_pages(smollm2):
    """The real model's arena is on 2 MB pages where the kernel gives them (THP `madvise` or
    `always`): its mapping shows anonymous huge pages."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.is_file() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    address = smollm2.model.blocks[10].ffn.fc.weight.data_ptr()
    huge_kb, inside = None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            huge_kb = int(line.split()[1])
            break
    assert huge_kb is not None and huge_kb * 1024 >= 64 * (2 << 20), f"AnonHugePages {huge_kb} kB"
