"""The encoder's data: works as token streams, cut into [CLS] passage [SEP] rows.

Masked-LM pretraining reads random windows of every training work; the genre task reads
windows of the works the First Folio catalogues (model/data/genres.py), labelled by genre.
Held-out works (manifest.json's val split) give fixed, non-overlapping passages.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from attnlens.model.data.genres import FOLIO_GENRE
from attnlens.model.tokenizer import Tokenizer


@dataclass
class Work:
    name: str
    split: str  # "train" | "val"
    text: str
    genre: str | None  # the Folio's genre, None for works it does not catalogue


def load_works(data_dir: str | Path) -> list[Work]:
    """Every work in manifest order, sha256-checked, with its Folio genre."""
    data_dir = Path(data_dir)
    manifest = json.loads((data_dir / "manifest.json").read_text(encoding="utf-8"))
    works = []
    for entry in manifest["works"]:
        data = gzip.decompress((data_dir / entry["file"]).read_bytes())
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ValueError(f"{data_dir / entry['file']}: sha256 does not match manifest.json")
        works.append(Work(entry["name"], entry["split"], data.decode("utf-8"),
                          FOLIO_GENRE.get(entry["name"])))
    return works


@dataclass
class TokenizedWork:
    name: str
    ids: torch.Tensor  # (N,) token ids of the whole work
    genre: str | None


def tokenize_works(tokenizer: Tokenizer, works: list[Work]) -> list[TokenizedWork]:
    encoded = tokenizer.encode_batch([w.text for w in works])
    return [TokenizedWork(w.name, torch.tensor(ids, dtype=torch.long), w.genre)
            for w, ids in zip(works, encoded)]


def special_id(token_id: int | None, token: str) -> int:
    """An encoder's special token id (tokenizer.cls_id, ...); a decoder's tokenizer has none."""
    if token_id is None:
        raise ValueError(f"the tokenizer has no {token} token: an encoder's tokenizer is needed")
    return token_id


def frame(body: torch.Tensor, tokenizer: Tokenizer) -> torch.Tensor:
    """(B, L) token rows -> (B, L + 2) rows [CLS] ... [SEP]."""
    B = body.shape[0]
    cls = torch.full((B, 1), special_id(tokenizer.cls_id, "[CLS]"), dtype=body.dtype)
    sep = torch.full((B, 1), special_id(tokenizer.sep_id, "[SEP]"), dtype=body.dtype)
    return torch.cat([cls, body, sep], dim=1)


def pad_rows(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of different lengths -> right-padded ids (B, T) and their real-token mask (B, T), 1/0."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for j, row in enumerate(rows):
        ids[j, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[j, : len(row)] = 1
    return ids, mask


def random_windows(works: list[TokenizedWork], length: int, batch_size: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, length), work index (B,)): works drawn in proportion to their length."""
    sizes = torch.tensor([max(0, len(w.ids) - length) + 1 for w in works], dtype=torch.float64)
    which = torch.multinomial(sizes, batch_size, replacement=True, generator=generator)
    rows = []
    for k in which.tolist():
        start = int(torch.randint(0, int(sizes[k]), (1,), generator=generator))
        rows.append(works[k].ids[start : start + length])
    return torch.stack(rows), which


def fixed_passages(works: list[TokenizedWork], length: int) -> tuple[torch.Tensor, list[int]]:
    """Consecutive non-overlapping windows of every work (a short tail is dropped):
    (ids (N, length), work index of each row)."""
    rows, owner = [], []
    for k, w in enumerate(works):
        for start in range(0, len(w.ids) - length + 1, length):
            rows.append(w.ids[start : start + length])
            owner.append(k)
    return torch.stack(rows), owner
