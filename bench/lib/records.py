"""One record format: a raw record of one run and a merged record of several, and the card each names.

Owns: `raw` (a run's record: its suite and `provenance` first, then its body), `write` (a record's
JSON and, when given, its markdown), `card_of` (the card a record names: its provenance, else the
fields older records used, else the results index `bench/results/CARDS.json`) and `stamp`.
Must never: write a record without its provenance, or name a card the record does not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.lib.provenance import provenance

RESULTS = Path(__file__).resolve().parents[1] / "results"
INDEX = RESULTS / "CARDS.json"


def raw(suite: str, device: str, body: dict[str, Any], argv: list[str] | None = None) -> dict[str, Any]:
    """A raw record of one run on `device`: suite, kind, provenance (read now), then the body."""
    return {"suite": suite, "kind": "raw", "provenance": provenance(device, argv), **body}


def write(record: dict[str, Any], json_path: Path, markdown: str | None = None) -> Path:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    if markdown is not None:
        json_path.with_suffix(".md").write_text(markdown)
    return json_path


def _legacy_card(rec: dict[str, Any]) -> str | None:
    """The device name older records kept (meta.device_name, device_name, device 'N x NAME')."""
    for where in (rec.get("meta") or {}, rec):
        name = where.get("device_name")
        if isinstance(name, str) and name not in ("cpu", "cuda"):
            return name
    dev = rec.get("device")
    if isinstance(dev, str) and " x " in dev:
        return dev.split(" x ", 1)[1]
    if dev == "cpu":
        return "cpu"
    return None


def indexed_card(name: str) -> str | None:
    try:
        entry = json.loads(INDEX.read_text())["files"].get(name)
    except (OSError, ValueError, KeyError):
        return None
    return entry.get("card") if entry else None


def card_of(rec: dict[str, Any], name: str | None = None) -> str | None:
    """The card a record was made on: its provenance, else the field an older record kept, else the
    results index's annotation of the file `name` (None when none of them tells)."""
    card = ((rec.get("provenance") or {}).get("card") or {}).get("name")
    if card:
        return card
    return _legacy_card(rec) or (indexed_card(name) if name else None)
