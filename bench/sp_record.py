"""The record of `bench/sp.py`: the configurations' names, the merge of its calls, the summary and
its markdown.

Owns: `CONFIGS` and their variants (`split_config`; `normalized`: an older call's names under
today's), `merge` (raw records of one card -> `<tag>.{json,md}`), `summarize` and the markdown.
Must never: measure (the runs are `bench/sp.py`'s).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import NamedTuple

from bench.lib import merge as merging
from bench.lib import records

TOKENS = {"image": 4096, "video": 32760}
ITERS = {"image": 5, "video": 3}
# sp2 halves one request's latency; it is chosen while its throughput stays within this fraction
# of a dp2 wave's (the same rule for the plan's estimates and for the measurement).
SP_THROUGHPUT_TOLERANCE = 0.10
# name: (ranks, engine mode, sp, what rank 1 runs)
CONFIGS = {
    "one_gpu_resident": (1, "resident", 1),
    "resident_ulysses2": (2, "resident", 2),
    "dlo_allgather_ulysses2": (2, "allgather", 2),
    "dlo_allgather_dp2": (2, "allgather", 1),
    "dlo_ranklocal_ulysses2": (2, "rank-local", 2),
}
# What `@lean` / `@overlap` ran (raw key `dlo_ulysses_version`): 1 (2026-11-30): the inputs exchanged
# while projecting, nothing else; 2 (2026-12-01, calls lean and lean-b): the copies folded, attention
# per destination query chunk sent peer to peer; 3: the copies folded, one attention call exchanged
# back token-major (engine/ulysses.py). `merge` names older ones `@overlap1`, `@lean2`, ...
DLO_ULYSSES_VERSION = 3


class Variant(NamedTuple):
    base: str  # a key of CONFIGS
    cap: str  # DLO_GATHER_MAX_CTAS, "" for none
    exchange: str  # DLO_ULYSSES, "diffusers" for diffusers' own Ulysses
    gather: str  # DLO_GATHER: "collective" or "peer"


def split_config(name: str) -> Variant:
    """`<config>[@lean|@overlap][@peer][@ctasN]` -> `Variant`: `dlo_allgather_ulysses2@ctas4` ->
    ("dlo_allgather_ulysses2", "4", "diffusers", "collective"); `@lean` / `@overlap`: Wan's
    self-attention through dlo.engine.ulysses (`DLO_ULYSSES=lean|overlap`) instead of diffusers'
    Ulysses; `@peer`: allgather's blocks rebuilt by peer copies (`DLO_GATHER=peer`). Older records'
    `@overlap1`, `@lean2`, ... (see DLO_ULYSSES_VERSION) parse, but only today's can run."""
    m = re.fullmatch(r"([a-z0-9_]+)(?:@((?:lean|overlap)\d?))?(@peer)?(?:@ctas(\d+))?", name)
    # one spelling per configuration: exchanges only with sp, peer gathers only in allgather mode
    if (not m or m[1] not in CONFIGS or (m[2] and CONFIGS[m[1]][2] == 1)
            or (m[3] and CONFIGS[m[1]][1] != "allgather")):
        raise SystemExit(f"unknown configuration {name!r}: one of {', '.join(CONFIGS)}, optionally @lean or "
                         "@overlap (sequence-parallel ones), @peer (allgather ones), then @ctasN")
    return Variant(m[1], m[4] or "", m[2] or "diffusers", "peer" if m[3] else "collective")


def normalized(rec: dict) -> dict:
    """A raw record under today's names. Two calls of 2026-11-30 (`ulysses_overlapped_unless_stock` in
    their raw files) ran while the overlapped exchanges were the default: their plain sequence-parallel
    names were overlapped and `@stock` was diffusers' Ulysses, which plain names are now. `@lean` /
    `@overlap` of an older DLO_ULYSSES_VERSION (raws without the key: 1 for those two calls, else 2)
    carry their version: `@overlap1`, `@lean2`."""
    stock = bool(rec.get("ulysses_overlapped_unless_stock"))
    version = rec.get("dlo_ulysses_version") or (1 if stock else 2)
    if not stock and version == DLO_ULYSSES_VERSION:
        return rec
    old = "" if version == DLO_ULYSSES_VERSION else str(version)

    def rename(n: str) -> str:
        base, *tags = n.split("@")
        if base not in CONFIGS:
            return n
        if "stock" in tags:
            tags.remove("stock")
        elif stock and CONFIGS[base][2] > 1:
            tags.insert(0, "overlap")
        return "@".join([base, *(t + old if t in ("lean", "overlap") else t for t in tags)])

    out = {k: v for k, v in rec.items() if k != "ulysses_overlapped_unless_stock"}
    for key in ("runs", "vs_one_gpu", "seconds", "skipped"):  # every map keyed by configuration
        out[key] = {rename(n): x for n, x in (rec.get(key) or {}).items()}
    out["renamed"] = {n: rename(n) for n in rec["runs"] if rename(n) != n}
    return out


def _secs(rec: dict, name: str, w: str) -> float | None:
    r = rec["runs"].get(name)
    if not isinstance(r, list) or w not in r[0]["workloads"]:
        return None
    return max(x["workloads"][w]["seconds"] for x in r)  # the slowest rank ends the call


def _layout_winner(sp2_thr: float, dp2_thr: float) -> str:
    """sp2 while its requests per second are within SP_THROUGHPUT_TOLERANCE of dp2's (one request
    then finishes about twice as soon), else dp2."""
    return "sp2" if sp2_thr >= dp2_thr * (1 - SP_THROUGHPUT_TOLERANCE) else "dp2"


def _resident_twin(name: str) -> str:
    """The resident Ulysses-2 configuration with `name`'s exchange (what its offload is measured against)."""
    exchange = split_config(name).exchange
    return "resident_ulysses2" + ("" if exchange == "diffusers" else f"@{exchange}")


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def summarize(rec: dict) -> dict:
    names = [*CONFIGS, *(n for n in rec["runs"] if "@" in n)]  # the variants after the base configurations
    s: dict = {"seconds_per_call": {w: {n: _secs(rec, n, w) for n in names} for w in ("video", "image")}}
    v = s["seconds_per_call"]["video"]
    s["sp2_over_resident_ulysses2_video"] = _ratio(v["dlo_allgather_ulysses2"], v["resident_ulysses2"])
    s["sp2_over_one_gpu_resident_video"] = _ratio(v["dlo_allgather_ulysses2"], v["one_gpu_resident"])
    s["resident_ulysses2_over_one_gpu_video"] = _ratio(v["resident_ulysses2"], v["one_gpu_resident"])
    # DLO's Ulysses exchanges (`@lean`, `@overlap`) against diffusers' Ulysses (one call per record)
    # (older records' `@overlap1`, `@lean2` ... under `overlap1_over_default_video` ...)
    s["lean_over_default_video"], s["overlap_over_default_video"] = {}, {}
    for n in rec["runs"]:
        base, cap, exchange, gather = split_config(n)
        if exchange != "diffusers" and not cap and gather == "collective":
            s.setdefault(f"{exchange}_over_default_video", {})[base] = _ratio(_secs(rec, n, "video"), v[base])
    # peer gathers (`@peer`) against the collective, the rest of the name the same
    s["peer_over_collective_video"] = {n.replace("@peer", ""): _ratio(_secs(rec, n, "video"),
                                                                      _secs(rec, n.replace("@peer", ""), "video"))
                                       for n in rec["runs"] if "@peer" in n}
    s["variants_over_one_gpu_video"] = {n: _ratio(_secs(rec, n, "video"), v["one_gpu_resident"])
                                        for n in rec["runs"] if "@" in n}
    s["sp2_over_resident_ulysses2_video_capped"] = {  # DLO_GATHER_MAX_CTAS variants, same call's baseline
        n: _ratio(_secs(rec, n, "video"), v["resident_ulysses2"]) for n in rec["runs"]
        if "@ctas" in n and split_config(n)[0] == "dlo_allgather_ulysses2"}
    # every streamed sp configuration against one GPU, and against resident Ulysses-2 with the same
    # exchange (`dlo_ranklocal_ulysses2@overlap` / `resident_ulysses2@overlap`): what offload adds
    streamed_sp = [n for n in rec["runs"] if (c := CONFIGS[split_config(n)[0]])[1] != "resident" and c[2] > 1]
    s["sp_over_one_gpu_video"] = {n: _ratio(_secs(rec, n, "video"), v["one_gpu_resident"]) for n in streamed_sp}
    s["offload_over_resident_video"] = {
        n: _ratio(_secs(rec, n, "video"), _secs(rec, _resident_twin(n), "video")) for n in streamed_sp}
    s["gather_wait_ms_per_call_video"] = {  # the slowest rank's wait for weights (records from 2026-12-02)
        n: max(x["workloads"]["video"]["gather_wait_ms_per_call"] for x in r)
        for n, r in rec["runs"].items() if isinstance(r, list) and "gather_wait_ms_per_call" in
        (r[0]["workloads"].get("video") or {})}
    vs = rec.get("vs_one_gpu") or {}
    s["vs_one_gpu"] = vs
    sp_vs = {n: x for n, x in vs.items() if CONFIGS[split_config(n)[0]][2] > 1}  # the sequence-parallel ones
    s["bit_identical_to_one_gpu"] = (all(c.get("bit_identical") for x in sp_vs.values() for c in x.values())
                                     if sp_vs else None)
    s["throughput_requests_per_second"] = {}
    s["policy"] = {}
    for w in ("image", "video"):
        t_sp2, t_wave = _secs(rec, "dlo_allgather_ulysses2", w), _secs(rec, "dlo_allgather_dp2", w)
        if t_sp2 is None or t_wave is None:
            continue
        thr = {"sp2": 1 / t_sp2, "dp2": 2 / t_wave}  # per transformer call: 1 request vs a wave of 2
        s["throughput_requests_per_second"][w] = thr
        s[f"{w}_sp2_over_dp2_wave"] = thr["sp2"] / thr["dp2"]
        measured = _layout_winner(thr["sp2"], thr["dp2"])
        plans = rec.get("plans") or {}
        est = {}
        for layout in ("dp2", "sp2"):
            # the plan's allgather estimate (the mode measured here): max(compute at the layout's
            # tokens per rank, transfer with g = 2); its own choice of mode is reported beside it
            # (records before 2026-12-02 planned on this node only, keyed `<workload>/<layout>`)
            p = plans.get(f"24GiB/{w}/{layout}") or plans.get(f"{w}/{layout}") or {}
            mode = (p.get("choice") or {}).get("mode")
            bs = ((p.get("modes") or {}).get("allgather") or {}).get("block_seconds")
            est[layout] = {"mode": mode, "block_seconds": bs, "reason": (p.get("choice") or {}).get("reason") or p.get("error")}
        if est["dp2"]["block_seconds"] and est["sp2"]["block_seconds"]:
            plan = _layout_winner(1 / est["sp2"]["block_seconds"], 2 / est["dp2"]["block_seconds"])
        else:
            plan = None
        s["policy"][f"{w}/2 devices"] = {
            "measured_winner": measured, "plan": plan, "match": plan == measured,
            "measured_seconds_per_call": {"sp2 (one request)": t_sp2, "dp2 (wave of two)": t_wave},
            "plan_block_seconds": {k: x["block_seconds"] for k, x in est.items()},
            "plan_modes": {k: x["mode"] for k, x in est.items()},
            "plan_sp2_over_dp2_throughput": (est["dp2"]["block_seconds"] / (2 * est["sp2"]["block_seconds"])
                                             if plan else None),
            "reason": f"throughput sp2/dp2 measured {thr['sp2'] / thr['dp2']:.3f}; sp2 while within "
                      f"{SP_THROUGHPUT_TOLERANCE:.0%} of dp2 (one request ~2x sooner); the plan's own mode "
                      f"choice: dp2 {est['dp2']['reason']}; sp2 {est['sp2']['reason']}",
        }
    s["image_sp2_over_dp2_wave"] = s.get("image_sp2_over_dp2_wave")
    # the offload mode the plan picks per workload and layout where the model cannot be resident
    s["plan_modes_24GiB"] = {k.split("/", 1)[1]: (p.get("choice") or {}).get("mode")
                             for k, p in (rec.get("plans") or {}).items() if k.startswith("24GiB/")}
    serve = rec.get("serve") or {}
    s["serve_bytes_identical_sp2_sp1"] = serve.get("bytes_identical_sp2_sp1")
    s["skipped"] = rec.get("skipped") or {}
    return s


def merge(args: argparse.Namespace) -> int:
    sources = [merging.Source(x.path, normalized(x.record)) for x in merging.load(args.raw_files)]
    raws = [x.record for x in sources]
    body = {k: v for k, v in raws[0].items() if k not in ("provenance", "suite", "kind")}
    body["device_name"] = merging.one_card(sources)
    body["renamed"] = {x.path.name: x.record["renamed"] for x in sources if x.record.get("renamed")}
    runs = merging.keyed(sources, "runs", keep_replaced=False)
    body["runs"] = {k: v for k, v in runs.items() if isinstance(v, list) or k in raws[0]["runs"]}
    body["vs_one_gpu"] = merging.keyed(sources, "vs_one_gpu", keep_replaced=False)
    for k in ("plans", "serve"):
        body[k] = next((r[k] for r in reversed(raws) if r.get(k)), None)
    rec = merging.merged("sp", sources, body)
    rec["summary"] = summarize(rec)
    md = _markdown(rec, args)
    records.write(rec, Path(args.out) / f"{args.tag}.json", md)
    print(md)
    return 0


def _fmt(x: float | None, scale: float = 1e3, nd: int = 1) -> str:
    return "" if x is None else f"{x * scale:.{nd}f}"


def _markdown(rec: dict, args: argparse.Namespace) -> str:
    s = rec["summary"]
    lines = [f"# {rec['devices']} x {rec['device_name']}: sequence parallelism with offload, {rec['layers']} "
             f"Wan2.1-14B layers", "",
             f"Merged with `python -m bench sp merge {' '.join(args.raw_files)} --tag {args.tag}`; each raw "
             "file is one device call (`run` command inside).", "",
             "| workload | configuration | ms per call | vs one GPU resident |", "|---|---|---|---|"]
    for w, per in s["seconds_per_call"].items():
        for n, t in per.items():
            c = (s["vs_one_gpu"].get(n) or {}).get(w)
            cmp = "" if c is None else ("bit-identical" if c.get("bit_identical") else
                                        f"max abs {c.get('max_abs_diff'):.3g}, PSNR {c.get('psnr_db'):.1f} dB")
            lines.append(f"| {w} | {n} | {_fmt(t)} | {cmp} |")
    lines += [""]
    for k in ("sp2_over_resident_ulysses2_video", "sp2_over_one_gpu_resident_video",
              "resident_ulysses2_over_one_gpu_video", "bit_identical_to_one_gpu", "image_sp2_over_dp2_wave",
              "video_sp2_over_dp2_wave", "serve_bytes_identical_sp2_sp1",
              *sorted(k for k in s if k.endswith("_over_default_video")),  # lean, overlap, older versions'
              "variants_over_one_gpu_video", "sp2_over_resident_ulysses2_video_capped", "sp_over_one_gpu_video",
              "offload_over_resident_video", "peer_over_collective_video", "gather_wait_ms_per_call_video",
              "plan_modes_24GiB", "skipped"):
        if k in s and s[k] != {}:
            lines.append(f"- `{k}`: {s[k]}")
    if rec.get("renamed"):
        lines.append(f"- runs renamed from the call's names (`normalized`): {rec['renamed']}")
    if s["policy"]:
        lines += ["", "Layout (`dlo plan` allgather estimates per layout for the full 40-block model on this node with a "
                  "24 GiB device, where it cannot be resident (records before 2026-12-02: this node as is); sp2 "
                  f"while its throughput is within {SP_THROUGHPUT_TOLERANCE:.0%} of dp2's) vs the measured winner:", ""]
        for k, v in s["policy"].items():
            lines.append(f"- {k}: measured {v['measured_winner']}, plan {v['plan']} "
                         f"({'match' if v['match'] else 'MISMATCH'}): {v['reason']}")
    return "\n".join(lines) + "\n"
