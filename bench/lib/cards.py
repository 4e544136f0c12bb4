"""Which card made each committed result: the index `bench/results/CARDS.json`, built from what the
files themselves say.

    python -m bench cards          # rewrite the index (a test holds it to the files)

Owns: `build` (every file under bench/results/: its card and how that was told, in this order: the
record's own field (provenance, or the field an older record kept: `device_name`, `meta`, `device`);
the records a merged record was made from; a card name or the plan's device budget in the logs of
its call (`EVIDENCE`, or its own text); a device peak no 80 GB card holds; a CPU-only suite; the
record beside it of the same stem; else "cannot be told", with what the record lacks) and
`misnamed` (a file whose name says one card while its record says another).
Must never: take a card from prose a program wrote regardless of the card (the product's messages
name "an H200 host" whatever runs them): only `NVIDIA ...` device names and device budgets count.
"""

from __future__ import annotations

import json
import re
import tarfile
from pathlib import Path
from typing import Any

from bench.lib.records import INDEX, RESULTS, _legacy_card

H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
NAME = re.compile(r"NVIDIA H[12]00(?: 80GB HBM3)?")
BUDGET = re.compile(r"device budget (?:of|is) ([\d.]+) GB|budget=([\d.]+) GB")
CAP = re.compile(r"device memory capped at (\d+) bytes \(([\d.]+) of the device\)")
LARGEST_80GB = 85.1e9  # an 80 GB card's bytes: a budget or peak above it is the H200's (of the cards lent)
CPU_SUITES = ("load-tiny-", "reliability-", "raw-reliability-", "operator-fleet-", "fp8-drift-tiny-", "-cpu-")
# the logs of the calls whose records name no card (file -> the log archives of the same call)
EVIDENCE: dict[str, list[str]] = {
    "raw-ready-h200-2026-12-01.json": ["logs/device-2026-12-01-ready-warm-cold.tgz"],
    "raw-ready-h200-2026-12-01-c.json": ["logs/device-2026-12-01-ready-c-profiled-cold.tgz"],
    **{f"raw-ready-h200-2026-12-0{d}-{x}.json": [f"logs/device-2026-12-0{d}-ready-{x}{'-profile' if x == 'h' else ''}.tgz"]
       for d, xs in ((1, "b"), (2, "defghi"), (3, "kl")) for x in xs},
    **{f"raw-ready-h200-2026-12-03-{x}.json": [f"ready-h200-2026-12-03-{x}-logs.tgz"] for x in "opqrs"},
    **{f"ready-h200-2026-12-03-{x}.json": [f"ready-h200-2026-12-03-{x}-logs.tgz"] for x in "mn"},  # raws not kept
    **{f"raw-seed-models-h200-2026-12-01-{m}.json": [f"logs/device-2026-12-01-seed-{m}.tgz"]
       for m in ("cosmos3-nano", "cosmos3-super", "minimax-h3", "cosmos3-nano-16px-warmup-failed")},
    "raw-serve-h200x2-2026-11-30.json": ["logs/h200x2-2026-11-30-serve-resident-dp1.log",
                                         "logs/h200x2-2026-11-30-serve-allgather-dp2.log"],
    "raw-serve-h200x2-2026-11-30-b.json": ["logs/h200x2-2026-11-30-b-serve-resident-dp1.log",
                                           "logs/h200x2-2026-11-30-b-serve-allgather-dp2.log"],
}


D = r"(\d{4}-\d\d-\d\d)"
# a log or text of a call -> the records of that call (a glob under bench/results/)
RELATED = [(re.compile(a.replace("DATE", D)), b) for a, b in (
    (r"^logs/device-DATE-call(\d+)-", r"raw-pipeline-\1-\2-*.json"),
    (r"^logs/device-DATE-call(\d+)-", r"raw-pipeline-\1-\2[a-z]-*.json"),
    (r"^logs/device-DATE-small-gpu-(.+)\.tgz$", r"raw-small-gpu-h200-\1-\2.json"),
    (r"^logs/(h200x2-sp)-DATE-", r"raw-\1-\2*.json"),
    (r"^logs/memory-bench-h200-DATE\.txt$", r"raw-memory-h200-\1-*.json"),
    (r"^lora-merge-(.+)\.(txt|md)$", r"raw-lora-merge-\1.json"),
    (r"^lora-run-DATE-(default-kernel)\.txt$", r"raw-lora-h200-\1-\2.json"),
    (r"^lora-run-DATE-(?:wan21-)?(kernel.*)\.txt$", r"raw-lora-h200-\1-wan21-\2.json"),
    (r"^lora-h200-DATE-(wan21-steps)-run\.txt$", r"raw-lora-h200-\1-\2.json"),
)]


# what is known of the records nothing tells the card of
UNTOLD = {
    "cold-start-cuda-2026-12-01.json": "the call found no memory cgroup and recorded no device name, budget or peak",
    "cuda-check-2026-11-29.json": "the first CUDA check kept peaks of 6.7 GB and no device name",
    "raw-import-profile-2026-11-30-bytecode.json": "imports only (no card used), on the GPU host's Python 3.12.3",
    "raw-import-profile-2026-11-30-no-bytecode.json": "imports only (no card used), on the GPU host's Python 3.12.3",
    "raw-pin-stall-2026-12-03.json": "the registration times of one file, no device name",
    "raw-ready-h200-2026-12-02-h-profile.json": "a py-spy profile of one start: its logs hold no budget line",
    "raw-ready-h200-2026-12-03-j.json": "no logs kept with this call",
    "raw-seed-models-h200-2026-12-01-cosmos3-super.json": "peaks up to 71 GB fit either card; its logs show the "
    "64 GiB cap, not the device's size",
    **{f"raw-serve-h200x2-2026-11-30{x}.json": "the serve raws keep no device name, budget or peak above 80 GB "
       "(the multi-GPU call of that host, raw-h200x2-2026-11-30-a, names NVIDIA H200)" for x in ("", "-b", "-c")},
}


def _related(name: str, index: dict[str, dict]) -> dict[str, Any]:
    for pattern, glob in RELATED:
        m = pattern.search(name)
        records = sorted(p.name for p in RESULTS.glob(m.expand(glob))) if m else []
        cards = {index.get(r, {}).get("card") for r in records}
        if records and len(cards) == 1 and None not in cards:
            return {"card": cards.pop(), "told_by": f"the records of its call ({', '.join(records)})"}
    return {}


def _texts(path: Path) -> list[str]:
    if path.suffix == ".tgz":
        with tarfile.open(path) as tar:
            return [tar.extractfile(m).read().decode(errors="replace") for m in tar.getmembers() if m.isfile()]
    return [path.read_text(errors="replace")]


def _from_text(texts: list[str]) -> tuple[str | None, str]:
    names = {n for t in texts for n in NAME.findall(t)}
    if len(names) == 1:
        return names.pop(), "a device name in its text"
    budgets = [float(a or b) for t in texts for a, b in BUDGET.findall(t)]
    budgets += [int(b) / float(f) / 1e9 for t in texts for b, f in CAP.findall(t)]
    if budgets and min(budgets) > LARGEST_80GB / 1e9:
        return H200, f"the plan's device budget of {max(budgets):.1f} GB in its logs (an 80 GB card has at most 85.1 GB)"
    return None, "no device name or budget in its text" if not names else f"several device names: {sorted(names)}"


def _peak(rec: Any) -> float:
    if isinstance(rec, dict):
        own = [float(v) for k, v in rec.items() if k == "peak_device_bytes" and isinstance(v, (int, float))]
        return max([*own, *(_peak(v) for v in rec.values())], default=0.0)
    if isinstance(rec, list):
        return max((_peak(v) for v in rec), default=0.0)
    return 0.0


def _sources(rec: dict) -> list[str]:
    names = rec.get("sources") or rec.get("files") or []
    if isinstance(names, str):
        names = re.findall(r"[\w./-]+\.json", names)
    return [Path(n if isinstance(n, str) else n.get("file", "")).name for n in names]


def _json_card(name: str, rec: Any, index: dict[str, dict]) -> dict[str, Any]:
    if isinstance(rec, dict):
        card = ((rec.get("provenance") or {}).get("card") or {}).get("name")
        if card:
            return {"card": card, "told_by": "its provenance (read from the device)"}
        legacy = _legacy_card(rec) or (rec["device"] if str(rec.get("device", "")).startswith("NVIDIA") else None)
        if legacy:
            return {"card": legacy, "told_by": "its own device field"}
        sources = _sources(rec)
        cards = {index.get(s, {}).get("card") for s in sources}
        if sources and len(cards) == 1 and None not in cards:
            return {"card": cards.pop(), "told_by": "the records it was merged from"}
        if sources and all(s in index for s in sources):
            untold = [s for s in sources if not index[s].get("card")]
            return {"card": None, "told_by": f"cannot be told: of the records it was merged from, {', '.join(untold)} "
                    "cannot be told" if untold else f"cannot be told: its records name several cards {sorted(cards)}"}
    if name in EVIDENCE:
        card, how = _from_text([t for e in EVIDENCE[name] for t in _texts(RESULTS / e)])
        if card:
            return {"card": card, "told_by": f"{how} ({', '.join(EVIDENCE[name])})"}
    if _peak(rec) > LARGEST_80GB:
        return {"card": H200, "told_by": f"a device peak of {_peak(rec) / 1e9:.1f} GB (more than an 80 GB card holds)"}
    return {}


def _card(path: Path, index: dict[str, dict]) -> dict[str, Any]:
    name = str(path.relative_to(RESULTS))
    if any(s in path.name for s in CPU_SUITES):
        return {"card": "cpu", "told_by": "a CPU-only run (its suite or its name)"}
    if path.suffix == ".json":
        got = _json_card(name, json.loads(path.read_text()), index)
        if got:
            return got
    folder = RESULTS / f"{path.parent.name}.json"
    if path.parent != RESULTS and folder.is_file():
        return {"card": index.get(folder.name, {}).get("card"), "told_by": f"the record of its folder ({folder.name})"}
    twin = re.sub(r"(-logs)?\.(md|png|txt|log|jsonl|tgz)$", ".json", path.name)
    for twin in (twin, f"raw-{twin}") if twin != path.name else ():
        if twin in index:
            told = "the record of the same stem" if index[twin].get("card") else index[twin]["told_by"] + "; as its record"
            return {"card": index[twin].get("card"), "told_by": f"{told} ({twin})"}
    related = _related(name, index)
    if related:
        return related
    if path.suffix in (".md", ".txt", ".log", ".tgz", ".jsonl"):
        card, how = _from_text(_texts(path))
        if card:
            return {"card": card, "told_by": how}
    why = UNTOLD.get(name) or "no device name, budget or peak above 80 GB in it or its logs"
    return {"card": None, "told_by": f"cannot be told: {why}"}


def misnamed(name: str, card: str | None) -> str | None:
    said = re.search(r"\b(h100|h200)", name)
    if said and card and said.group(1).upper() not in card:
        return f"the name says {said.group(1)}, the record says {card}"
    return None


def build() -> dict[str, Any]:
    files = sorted((p for p in RESULTS.rglob("*") if p.is_file() and p != INDEX),
                   key=lambda p: (p.suffix != ".json", "/" in str(p.relative_to(RESULTS)), p.name))
    index: dict[str, dict] = {}
    for _ in range(2):  # merged records after the raws they name
        for p in files:
            entry = _card(p, index)
            note = misnamed(p.name, entry.get("card"))
            index[str(p.relative_to(RESULTS))] = {**entry, **({"misnamed": note} if note else {})}
    return {"about": "the card each committed result came from, and how that was told (python -m bench cards)",
            "files": dict(sorted(index.items()))}


def main(tool: str, argv: list[str]) -> int:
    INDEX.write_text(json.dumps(build(), indent=1) + "\n")
    files = json.loads(INDEX.read_text())["files"]
    unknown = [n for n, e in files.items() if not e.get("card")]
    print(f"wrote {INDEX}: {len(files)} files, {len(unknown)} whose card cannot be told")
    return 0
