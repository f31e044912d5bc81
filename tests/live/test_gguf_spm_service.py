"""GGUF files with a SentencePiece tokenizer, the whole way: a random Llama (Q8_0, the space
prefix) imported by the `import-hf` command and served by a real `attnlens serve` process, and a
random Gemma 2 (no prefix) imported and served in-process. /attention's ids are the
`sentencepiece` library's (BOS first) and its maps transformers' on the same file; /generate
answers with the model's own greedy continuation."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import torch
from live_server import live_server

from attnlens.model import SamplingParams, generate_tokens, load_checkpoint
from attnlens.model.interop.convert import import_checkpoint

pytestmark = pytest.mark.slow
pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from helpers import write_gguf  # noqa: E402
from spm_helpers import CONTROL, spm_vocab, train_sentencepiece  # noqa: E402

PROMPT = "Full fathom five thy father lies; of his bones are coral made"


def greedy(ckpt, ids: list[int], n: int) -> list[int]:
    """The model's own greedy continuation of ids, up to its first stop token."""
    ref = [t.id for t in generate_tokens(ckpt.model, ids, n, SamplingParams(temperature=0))]
    return ref[:next((i for i, t in enumerate(ref) if t in ckpt.tokenizer.eos_ids), len(ref))]


def check_generate(answer: dict, ckpt, ids: list[int], n: int) -> None:
    want = greedy(ckpt, ids, n)
    assert [t["id"] for t in answer["tokens"]] == want and answer["usage"]["prompt_tokens"] == len(ids)
    assert answer["text"] == ckpt.tokenizer.decode_bytes(want).decode("utf-8", errors="replace")


def test_a_llama_file_imported_by_the_command_is_served(tmp_path):
    sp = train_sentencepiece(True)
    src = write_gguf(tmp_path / "llama.gguf", name="tiny-llama", qtype="Q8_0", context=64, seed=4,
                     spm=spm_vocab(sp, add_space_prefix=True, added=(("<|im_end|>", CONTROL),)))
    run = [sys.executable, "-m", "attnlens.app.cli", "import-hf", "--src", str(src), "--out", str(tmp_path / "ckpt")]
    done = subprocess.run(run, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    ckpt = load_checkpoint(tmp_path / "ckpt")
    ids = ckpt.tokenizer.encode_prompt(PROMPT)
    assert ids == [1, *sp.encode(PROMPT)]  # the tokenizer as saved and loaded again
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=src.name, dtype=torch.float32,
                                                           attn_implementation="eager")
    with torch.no_grad():
        want_maps = torch.stack([a[0] for a in hf(torch.tensor([ids]), output_attentions=True).attentions])
    env = {"OMP_NUM_THREADS": "1", "ATTNLENS_LOG_LEVEL": "warning"}
    with live_server(tmp_path / "ckpt", tmp_path, env=env) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as http:
        d = http.post("/attention", json={"text": PROMPT, "format": "json"}).json()
        g = http.post("/generate", json={"prompt": PROMPT, "max_new_tokens": 8, "temperature": 0}).json()
    assert [t["id"] for t in d["tokens"]] == ids and d["shape"] == [2, 4, len(ids), len(ids)]
    assert "".join(t["text"] for t in d["tokens"][1:]) == " " + PROMPT  # the prefix "▁" shown as a space
    torch.testing.assert_close(torch.tensor(d["attention"]), want_maps, atol=1e-5, rtol=0)
    check_generate(g, ckpt, ids, 8)


def test_a_gemma2_file_without_the_space_prefix_is_served(tmp_path):
    """In-process; the maps equal those of the transformers model the file was written from."""
    from fastapi.testclient import TestClient
    from test_gguf_more import write_model_gguf

    from attnlens.app.server.main import create_app
    from attnlens.app.server.settings import Settings

    sp = train_sentencepiece(False)
    hf = write_model_gguf("gemma2", tmp_path / "gemma.gguf", "F32", seed=5,
                          spm=spm_vocab(sp, add_space_prefix=False, added=(("<end_of_turn>", CONTROL),)))
    out, _ = import_checkpoint(tmp_path / "gemma.gguf", tmp_path / "ckpt")
    ckpt = load_checkpoint(out)
    ids = ckpt.tokenizer.encode_prompt(PROMPT)
    assert ids == [1, *sp.encode(PROMPT)]
    assert ckpt.tokenizer.eos_ids == {2, ckpt.tokenizer.backend.token_to_id("<end_of_turn>")}
    with torch.no_grad():
        want_maps = torch.stack([a[0] for a in hf(torch.tensor([ids]), output_attentions=True).attentions])
    with TestClient(create_app(Settings(model=out, device="cpu", warmup=False))) as client:
        d = client.post("/attention", json={"text": PROMPT, "format": "json"}).json()
        g = client.post("/generate", json={"prompt": PROMPT, "max_new_tokens": 8, "temperature": 0}).json()
    assert [t["id"] for t in d["tokens"]] == ids
    assert "".join(t["text"] for t in d["tokens"][1:]) == PROMPT  # no prefix
    torch.testing.assert_close(torch.tensor(d["attention"]), want_maps, atol=1e-4, rtol=0)
    check_generate(g, ckpt, ids, 8)
