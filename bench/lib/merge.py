"""The one merge: several raw records of a suite into one record, from one card.

Owns: `Source` (a raw record and the card it names), `load`, `one_card` (every source's card the
same, else `MergeError` naming each file's), `keyed` (a suite's runs by name across sources: a later
source's run replaces an earlier one, which stays beside it as `NAME@FILE-STEM`), `joined` (lists
concatenated) and `merged` (the merged record: suite, card, each source's file, card, commit and
command, then the suite's body). A suite adds only its summary and its markdown.
Must never: change a raw record's numbers, or join records of different cards unless told to (and
then every source's card stays named).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lib.records import card_of


class MergeError(ValueError):
    pass


@dataclass(frozen=True)
class Source:
    path: Path
    record: dict[str, Any]

    @property
    def card(self) -> str | None:
        return card_of(self.record, self.path.name)

    def summary(self) -> dict[str, Any]:
        prov = self.record.get("provenance") or {}
        command = prov.get("command") or self.record.get("command") or (self.record.get("meta") or {}).get("command")
        return {"file": self.path.name, "card": self.card, "commit": (prov.get("commit") or {}).get("sha"),
                "command": command}


def load(paths: list[Path] | list[str]) -> list[Source]:
    if not paths:
        raise MergeError("nothing to merge: name at least one raw record")
    return [Source(Path(p), json.loads(Path(p).read_text())) for p in paths]


def one_card(sources: list[Source], *, mixed: bool = False) -> str | None:
    """The card the sources name (a source whose card cannot be told stays so in the sources list);
    with `mixed`, None when they differ (each source keeps its own)."""
    cards = {s.card for s in sources if s.card}
    if len(cards) <= 1:
        return cards.pop() if cards else None
    if mixed:
        return None
    named = ", ".join(f"{s.path.name}: {s.card or 'unknown'}" for s in sources)
    raise MergeError(f"the sources were made on different cards ({named}); a record is one card's "
                     "(merge them apart, or pass --mixed-cards to keep each source's card beside its runs)")


def keyed(sources: list[Source], key: str, *, depth: int = 1, keep_replaced: bool = True) -> dict[str, Any]:
    """`record[key]` of every source merged by name, `depth` levels down (2: model -> run): a later
    source's entry replaces an earlier one of the same name, which stays as `NAME@FILE-STEM` unless
    `keep_replaced` is False (a suite whose names carry their own `@` variants)."""
    out: dict[str, Any] = {}
    origin: dict[tuple[str, ...], str] = {}
    for s in sources:
        _into(out, s.record.get(key) or {}, s.path.stem, depth, (), origin, keep_replaced)
    return out


def _into(out: dict[str, Any], part: dict[str, Any], stem: str, depth: int, at: tuple[str, ...],
          origin: dict[tuple[str, ...], str], keep: bool) -> None:
    for name, value in part.items():
        here = (*at, name)
        if depth > 1 and isinstance(value, dict):
            _into(out.setdefault(name, {}), value, stem, depth - 1, here, origin, keep)
            continue
        if keep and name in out and out[name] != value:
            out[f"{name}@{origin[here]}"] = out[name]
        out[name] = value
        origin[here] = stem


def joined(sources: list[Source], key: str) -> list[Any]:
    return [x for s in sources for x in (s.record.get(key) or [])]


def merged(suite: str, sources: list[Source], body: dict[str, Any], *, mixed: bool = False) -> dict[str, Any]:
    return {"suite": suite, "kind": "merged", "card": one_card(sources, mixed=mixed),
            "sources": [s.summary() for s in sources], **body}
