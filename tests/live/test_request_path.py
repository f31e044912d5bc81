"""The request path stays short and the README says it as it is: bench/request_path.py records every
call while one POST /attention and one streamed chat completion run on SmolLM2, and the modules
they enter (in order) are the README's lists, within issue 49's bounds (/attention at most 15
modules and 2 call-backs, the chat at most 18 modules)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers import REPO_ROOT, installed_packaged_file

pytestmark = pytest.mark.slow

BOUNDS = {"POST /attention": (15, 2), "POST /v1/chat/completions (streamed)": (18, None)}
README_TITLES = {"POST /attention": "**POST /attention**", "POST /v1/chat/completions (streamed)":
                 "**A streamed chat completion**"}


def measured() -> dict[str, tuple[list[str], int]]:
    """Each request's modules in order and its count of call-backs, as the tool prints them."""
    out = subprocess.run([sys.executable, "bench/request_path.py", "--spine"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    paths: dict[str, tuple[list[str], int]] = {}
    title = None
    for line in out.splitlines():
        if head := re.match(r"(.+): HTTP (\d+), (\d+) modules, (\d+) call-backs", line):
            assert head[2] == "200", line
            title = head[1]
            paths[title] = ([], int(head[4]))
        elif item := re.match(r"\s+\d+\. (\S+)", line):
            assert title is not None
            paths[title][0].append(item[1])
    return paths


def readme_lists() -> dict[str, list[str]]:
    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index("## Architecture"):]
    lists = {}
    for title, marker in README_TITLES.items():
        item = section[section.index(marker):]
        item = item[: item.index("\n- ") if "\n- " in item else item.index("\n\n")]
        lists[title] = re.findall(r"`((?:app|model|attnlens)/[^`]+\.py)`", item)
    return lists


def test_the_readme_lists_the_modules_each_request_really_enters_within_bounds():
    from attnlens.model.interop.packaged import PACKAGED

    installed_packaged_file(next(m for m in PACKAGED if m.default))
    paths, readme = measured(), readme_lists()
    assert set(paths) == set(BOUNDS)
    for title, (modules, callbacks) in paths.items():
        most_modules, most_callbacks = BOUNDS[title]
        assert len(modules) <= most_modules, (title, modules)
        assert most_callbacks is None or callbacks <= most_callbacks, (title, callbacks)
        assert readme[title] == modules, f"the README's list for {title} is not the path as it runs"
