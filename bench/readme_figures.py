"""The figures the README shows, each computed from its newest record with its spread.

Owns: `Topic` (a table of figures, the records it reads and the card they name) and one function a
topic (`TOPICS`), each reading the newest records of its kind (`newest`: the latest date among the
files its globs match, every file of that date) through the one merge's `keyed` where a topic joins
calls. Every figure is a median with its n and min-max, the first request beside it where the call
timed it apart; a ratio divides medians by medians (and first requests by first requests) of one call.
Must never: keep the best of several tries, or show a figure without the record and card behind it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bench.lib import merge as merging
from bench.lib.records import RESULTS, card_of
from bench.lib.stats import ratio, spread, text

DATE = re.compile(r"\d{4}-\d\d-\d\d")


@dataclass(frozen=True)
class Topic:
    key: str
    title: str
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    records: tuple[str, ...]
    note: str = ""

    @property
    def cards(self) -> list[str]:
        named = {card_of(json.loads((RESULTS / r).read_text()), r) for r in self.records}
        return sorted(c or "not recorded" for c in named)


def record_date(path: Path) -> str:
    rec = json.loads(path.read_text())
    prov = rec.get("provenance") or {}
    named = DATE.search(path.name)
    found = prov.get("date") or (named and named.group(0)) or (rec.get("meta") or {}).get("date") or rec.get("date")
    return str(found)[:10]


def newest(*globs: str, root: Path = RESULTS) -> list[Path]:
    """Every record of the latest date among those the globs match (one day's calls of a kind)."""
    files = sorted({p for g in globs for p in root.glob(g)})
    if not files:
        raise FileNotFoundError(f"no record matches {globs}")
    latest = max(record_date(p) for p in files)
    return [p for p in files if record_date(p) == latest]


def latest(*globs: str, root: Path = RESULTS) -> Path:
    """The one newest record: the latest date, then the last name of that date (`-b` after the first)."""
    return max(newest(*globs, root=root), key=lambda p: p.stem)


def ms(s: dict[str, Any], scale: float = 1e3) -> str:
    """Seconds (or, with scale 1, milliseconds) as milliseconds with their spread."""
    return text(s, " ms", scale=scale, digits=0 if s["median"] * scale >= 1000 else 1, first=False)


def secs(s: dict[str, Any], digits: int = 2) -> str:
    return text(s, " s", digits=digits)


def x(r: dict[str, Any]) -> str:
    first = f"; first requests {r['first']:.3f}x" if r.get("first") is not None else ""
    return f"{r['median']:.3f}x{first}"


def offload() -> Topic:
    from bench.offload import DEFAULT_PATH, call_spread, summarise

    files = newest("raw-h200-40l-*.json", "raw-offload-40l-*.json")
    sources = merging.load(files)
    results = merging.keyed(sources, "results", keep_replaced=False)
    first = sources[0].record
    s = summarise(results, first["block_bytes"], first["model_bytes"], first["layers"])
    ws = ("image", "video")

    def row(label: str, name: str) -> tuple[str, ...]:
        cells = []
        for w in ws:
            c = call_spread(results[name]["workloads"][w])
            cells.append(f"{ms(c, 1)}; {c['median'] / s[w]['bound_ms']:.3f}x bound")
        return (label, *cells)

    fastest = {w: s[w]["fastest_dlo_variant"] for w in ws}
    rows = [("resident (the whole model on the card)", *(ms(call_spread(results["resident"]["workloads"][w]), 1)
                                                        for w in ws)),
            ("physical bound (per block: max(compute, copy at the measured H2D))",
             *(f"{s[w]['bound_ms']:,.0f} ms" for w in ws)),
            row("**DLO, the default path** (rank-local, page cache registered)", DEFAULT_PATH)]
    for name in sorted(set(fastest.values()) - {DEFAULT_PATH}):
        rows.append(row(f"DLO's fastest variant here (`{name}`, not the default)", name))
    for name, label in (("diffusers_leaf_stream", "diffusers group offloading, leaf_level + stream"),
                        ("diffusers_block_stream", "diffusers group offloading, block_level + stream"),
                        ("sequential", "accelerate sequential offload")):
        if name in results:
            rows.append(row(label, name))
    return Topic("offload", f"One card, Wan2.1-14B dimensions ({first['layers']} blocks, "
                 f"{first['model_bytes'] / 1e9:.1f} GB bf16), one transformer call",
                 ("", "image-like, 4,096 tokens", "video 480p, 32,760 tokens"), tuple(rows),
                 tuple(p.name for p in files),
                 "Times are medians of the timed calls after two warm-up calls (min-max beside them); "
                 "these calls did not time the warm-up apart, so no first request is shown.")


def two_cards() -> Topic:
    path = latest("raw-h200x2-20*-a.json", "raw-multi-gpu-*.json")
    runs = json.loads(path.read_text())["runs"]
    rows = []
    for mode, label in (("resident", "resident, one request"), ("rank-local", "rank-local, one request"),
                        ("allgather", "**allgather, one request** (the other rank gathers only)")):
        w = {k: spread(v["single_all"], first=v.get("single_first_seconds")) for k, v in runs[mode][0]["workloads"].items()}
        rows.append((label, *(ms(w[k]) for k in ("image", "video"))))
    ag = {k: v for k, v in runs["allgather"][0]["workloads"].items()}
    rows.append(("allgather, a wave of 2 requests over one request (medians)",
                 *(x(ratio(spread(ag[k]["wave_all"], first=None), spread(ag[k]["single_all"], first=None)))
                   for k in ("image", "video"))))
    rl = runs["rank-local"][0]["workloads"]["image"]
    rows.append(("allgather over rank-local, one image request (medians)",
                 x(ratio(spread(ag["image"]["single_all"], first=None), spread(rl["single_all"], first=None))), ""))
    return Topic("two-cards", "Two cards (NVLink), 16 blocks of the same dimensions",
                 ("", "image-like, 4,096 tokens", "video 480p, 32,760 tokens"), tuple(rows), (path.name,))


def serve_waves() -> Topic:
    files = newest("raw-serve-h200x2-*.json", "raw-serve-*.json")
    per: dict[str, dict[str, list[float]]] = {}
    for p in files:
        for c in json.loads(p.read_text())["configs"]:
            got = per.setdefault(f"{c['mode']}, dp {c['dp']}", {"waves": [], "first": [], "exit": []})
            if "wave_throughput_over_single" in c and c["dp"] > 1:
                got["waves"].append(c["wave_throughput_over_single"])
            if "first_request_over_warm" in c:
                got["first"].append(c["first_request_over_warm"])
            if c.get("exit_code") == 0:
                got["exit"].append(c["exit_seconds"])

    def cell(xs: list[float], unit: str) -> str:
        return text(spread(xs, first=None), unit, digits=2, first=False) if xs else "-"

    rows = [(k, cell(v["waves"], "x"), cell(v["first"], "x"), cell(v["exit"], " s")) for k, v in sorted(per.items())]
    return Topic("serve-waves", "Through `dlo serve` and the openai SDK: 8 waves of 2 requests against 8 requests "
                 "one after another, the first request, and an idle server's exit on SIGTERM (each call one sample)",
                 ("", "throughput of waves over sequential", "first request after ready over the warm median",
                  "SIGTERM to every process gone, exit 0"), tuple(rows), tuple(p.name for p in files))


def host_memory() -> Topic:
    files = newest("raw-h200-40l-*.json", "raw-offload-40l-*.json")
    results = merging.keyed(merging.load(files), "results", keep_replaced=False)
    model = json.loads(files[0].read_text())["model_bytes"]
    base = results["resident"]["pss_anon_growth_bytes"]
    rows = []
    for name, label in (("dlo_rank_local_registered", "page cache registered for DMA (the default)"),
                        ("dlo_rank_local_arena", "one pinned arena (where registering is not possible)")):
        if name in results:
            r = results[name]
            rows.append((label, f"{(r['pss_anon_growth_bytes'] - base) / model:.2%} of the model",
                         f"{r['report']['host_pinned_bytes'] / 1e9:.2f} GB"))
    return Topic("host-memory", "Host memory of one rank beyond what the resident baseline's process grows by (the "
                 "CUDA context, the libraries), the model streamed", ("", "anonymous memory (PSS) added",
                                                                      "host bytes pinned"), tuple(rows),
                 tuple(p.name for p in files))


TOPICS: list[Callable[[], Topic]] = [offload, two_cards, serve_waves, host_memory]
