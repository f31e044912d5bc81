"""The heads a request ablates (`ablate=` on attention, generate, stream, logits, lens, explain).

The API takes a list of {"layer", "head", "how": "zero" | "mean", "group": name | None}. The
client also reads the page's compact text form (its URL's `ablate`), one entry per comma:

    "2.2z,3.1m"            layer 2 head 2 zeroed, layer 3 head 1 mean-ablated
    "cross:0.1z"           a group other than the family's default one, named before a colon
    "2.2"                  no letter: zero

and Ablation objects (what an answer's `ablate` echoes), so an answer's ablations can be asked
again. Whether a layer, head or group exists is the server's to say (a 400 naming `ablate`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Union

HOW: dict[str, Literal["zero", "mean"]] = {"z": "zero", "m": "mean"}
CODE = {how: letter for letter, how in HOW.items()}
_ENTRY = re.compile(r"^(?:([A-Za-z][\w-]*):)?(\d+)\.(\d+)([zmZM]?)$")


@dataclass(frozen=True)
class Ablation:
    """One ablated head: its output before the output projection (z) set to 0 ("zero") or to its
    mean over the sequence's positions ("mean"), in attention `group` (None: the family's default)."""

    layer: int
    head: int
    how: Literal["zero", "mean"] = "zero"
    group: str | None = None

    @classmethod
    def from_json(cls, d: dict) -> Ablation:
        return cls(int(d["layer"]), int(d["head"]), d.get("how", "zero"), d.get("group"))

    def to_json(self) -> dict:
        return {"layer": self.layer, "head": self.head, "how": self.how, "group": self.group}

    def __str__(self) -> str:
        return f"{self.group + ':' if self.group else ''}{self.layer}.{self.head}{CODE.get(self.how, 'z')}"


AblateSpec = Union[str, Iterable[Union[dict, Ablation]], None]


def parse_ablation(text: str) -> list[Ablation]:
    """The compact form ("2.2z,3.1m,cross:0.1z") as Ablations; a malformed entry is a ValueError."""
    out = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        m = _ENTRY.match(entry)
        if m is None:
            raise ValueError(f"ablate: cannot read {entry!r}: write [group:]layer.head[z|m], e.g. '2.2z' or "
                             f"'cross:0.1m' (z: zero, m: mean)")
        group, layer, head, how = m.groups()
        out.append(Ablation(int(layer), int(head), HOW[how.lower()] if how else "zero", group))
    return out


def format_ablation(ablate: Iterable[Ablation | dict]) -> str:
    """The compact text form of a list of ablations (the page's URL writes the same)."""
    return ",".join(str(a if isinstance(a, Ablation) else Ablation.from_json(a)) for a in ablate)


def ablate_body(ablate: AblateSpec) -> list[dict] | None:
    """A request's `ablate` field from any of the forms above (None: no field)."""
    if ablate is None:
        return None
    if isinstance(ablate, str):
        return [a.to_json() for a in parse_ablation(ablate)]
    out = []
    for a in ablate:
        if isinstance(a, Ablation):
            out.append(a.to_json())
        elif isinstance(a, dict):
            out.append(dict(a))  # as given: the server checks its fields (422 / 400 naming ablate)
        else:
            raise TypeError(f"ablate: an entry is a dict or an attnlens.Ablation, not {type(a).__name__} "
                            f"(or give the whole list as text, e.g. '2.2z,3.1m')")
    return out
