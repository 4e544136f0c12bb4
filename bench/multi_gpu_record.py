"""The record of `bench/multi_gpu.py`: the merge of its calls (and of `bench/serve.py`'s serve calls
beside them), the summary and its markdown.

Owns: `merge` (raw records of one card -> `<tag>.{json,md}`), the allgather bound, every figure's
spread (`_spread`) and the serve calls' throughput ratios (`serve_throughput`: each call a sample).
Must never: measure (the runs are `bench/multi_gpu.py`'s), or keep the best call alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.lib import merge as merging
from bench.lib import records
from bench.lib.stats import spread

NEAR_TIE = 0.05  # rank-local wins a tie within 5% (the policy's rule)


def _bound_seconds(rec: dict, w: int, resident_single: float, mode: str) -> float:
    """Per block max(compute, transfer), with the compute per block from resident (non-block work
    included, as in the single-GPU record): allgather's transfer is max(shard H2D, AllGather)."""
    layers, b = rec["layers"], rec["block_bytes"]
    c = rec["collectives"][0] if rec.get("collectives") else None
    compute = resident_single / layers
    if mode == "allgather" and c:
        g = rec["dp"]
        transfer = max(c["shard_h2d_seconds"], (g - 1) / g * b / c["allgather_busbw_bps"])
    else:
        h2d = c["concurrent_h2d_bps"] if c else 55e9
        transfer = b / h2d
    return layers * max(compute, transfer)


def merge(args: argparse.Namespace) -> int:
    sources = merging.load(args.raw_files)
    raws = [s.record for s in sources]
    body = {k: v for k, v in raws[0].items() if k not in ("provenance", "suite", "kind", "runs")}
    body["device_name"] = merging.one_card(sources)
    body["runs"] = {k: v for k, v in merging.keyed(sources, "runs").items() if isinstance(v, list)}
    body["collectives"] = next((r["collectives"] for r in raws if r.get("collectives")), None)
    body["policy"] = next((r["policy"] for r in reversed(raws) if r.get("policy")), None)
    rec = merging.merged("multi-gpu", sources, body)
    runs = rec["runs"]
    ws = [w for w in ("image", "video") if any(w in v[0]["workloads"] for v in runs.values())]
    dp = str(rec["dp"])
    s: dict = {"wave_scaling_efficiency": {}, "wave_over_best_single": {}, "single_seconds": {},
               "wave_seconds": {}, "over_resident": {}}
    shas: dict[str, set] = {}
    for w in ws:
        single = {m: v[0]["workloads"][w]["single_seconds"] for m, v in runs.items() if w in v[0]["workloads"]}
        wave = {m: max(x["workloads"][w]["wave_seconds"] for x in v) for m, v in runs.items()
                if w in v[0]["workloads"] and v[0]["workloads"][w]["wave_seconds"] is not None}
        s["single_seconds"][w], s["wave_seconds"][w] = single, wave
        s.setdefault("single_spread", {})[w] = {m: _spread(v[0]["workloads"][w], "single") for m, v in runs.items()
                                                if w in v[0]["workloads"]}
        # Same mode, same dp: a wave of dp requests against one request with the others gathering.
        s["wave_scaling_efficiency"][w] = {dp: {m: single[m] / wave[m] for m in wave}}
        s["wave_over_best_single"][w] = {dp: {m: min(single.values()) / wave[m] for m in wave}}
        if "resident" in single:
            s["over_resident"][w] = {m: single[m] / single["resident"] for m in single}
        shas[w] = {v[0]["workloads"][w]["sha256_seed1"] for v in runs.values() if w in v[0]["workloads"]}
    s["sha256_equal"] = all(len(x) == 1 for x in shas.values())
    img = s["single_seconds"].get("image", {})
    if {"allgather", "rank-local"} <= img.keys():
        s["allgather_single_over_rank_local_image"] = img["allgather"] / img["rank-local"]
    if {"allgather", "resident"} <= img.keys() and rec.get("collectives"):
        bound = _bound_seconds(rec, 0, img["resident"], "allgather")
        s["allgather_bound_seconds_image"] = bound
        s["allgather_single_over_bound_image"] = img["allgather"] / bound
    s["graph_equals_eager"] = (
        runs["allgather"][0]["workloads"]["image"]["sha256_seed1"]
        == runs["allgather-eager"][0]["workloads"]["image"]["sha256_seed1"]
        if {"allgather", "allgather-eager"} <= runs.keys() else None)
    s["host_us_per_block"] = {m: {w: x["host_us_per_block"] for w, x in v[0]["workloads"].items()} for m, v in runs.items()}
    s["memory"] = {m: {"peak_device_bytes_per_rank": [max((x["peak_device_bytes"] or 0) for x in r["workloads"].values())
                                                      for r in v],
                       "host_pinned_bytes_per_rank": [r["report"]["host_pinned_bytes"] for r in v],
                       "weights_source": v[0]["report"]["weights_source"],
                       "anon_growth_bytes_per_rank": [r["anon_growth_bytes"] for r in v],
                       "page_cache_growth_bytes": v[0]["page_cache_growth_bytes"]} for m, v in runs.items()}
    pol = rec.get("policy") or {}
    s["policy"] = {}
    for w in ws:
        single = s["single_seconds"][w]
        if not {"allgather", "rank-local"} <= single.keys():
            continue
        ag, rl = single["allgather"], single["rank-local"]
        winner = "rank-local" if rl <= ag * (1 + NEAR_TIE) else "allgather"
        plan = (pol.get("plans") or {}).get(f"24GiB/{w}") or {}
        choice = (plan.get("choice") or {})
        chosen = (choice.get("mode") or "").replace("_", "-")
        s["policy"][f"{w}/dp{dp}"] = {"measured_winner": winner, "plan": chosen, "match": chosen == winner,
                                      "reason": choice.get("reason") or plan.get("error"),
                                      "measured_ms": {"allgather": ag * 1e3, "rank-local": rl * 1e3},
                                      "on_this_node": ((pol.get("plans") or {}).get(f"node/{w}") or {}).get("choice")}
    if args.serve:
        # One entry per serve run (each a device call), keyed by file name; per mode, the first run (in
        # the order given) that measured it heads the summary, every run's are kept under `serve_runs`.
        serve_sources = merging.load(args.serve)
        rec["card"] = merging.one_card(sources + serve_sources)  # a serve raw's card may not be told
        rec["sources"] += [x.summary() for x in serve_sources]
        serves = {x.path.stem: x.record for x in serve_sources}
        rec["serve"] = serves
        s["serve_runs"] = {k: {**v.get("summary", {}), "command": v.get("command")} for k, v in serves.items()}
        s["serve_wave_throughput_over_single"] = serve_throughput(serves)
        s["first_request_over_warm"] = {k: v.get("first_request_over_warm") for k, v in s["serve_runs"].items()}
        s["shutdown_seconds"] = {k: v.get("shutdown_seconds") for k, v in s["serve_runs"].items()}
    rec["summary"] = s
    md = _markdown(rec, args)
    records.write(rec, Path(args.out) / f"{args.tag}.json", md)
    print(md)
    return 0


def _spread(workload: dict, kind: str) -> dict | None:
    """A mode's calls of one workload (rank 0's): the warm-up call is untimed, so no first."""
    samples = workload.get(f"{kind}_all") or ([workload[f"{kind}_seconds"]] if workload.get(f"{kind}_seconds") else [])
    return spread(samples, first=workload.get(f"{kind}_first_seconds")) if samples else None


def serve_throughput(serves: dict[str, dict]) -> dict[str, dict]:
    """Per mode, every serve call's wave throughput over sequential single requests: each call is a
    sample (its median of the spread across calls, never the best call alone)."""
    per_mode: dict[str, dict[str, float]] = {}
    for name, v in serves.items():
        for mode, ratio in (v.get("summary", {}).get("wave_throughput_over_single") or {}).items():
            per_mode.setdefault(mode, {})[name] = ratio
    return {mode: {"calls": calls, **spread(list(calls.values()), first=None)} for mode, calls in per_mode.items()}


def _markdown(rec: dict, args: argparse.Namespace) -> str:
    s, dp = rec["summary"], str(rec["dp"])
    c = rec.get("collectives") or []
    lines = [f"# {rec['devices']} x {rec['device_name']}: {rec['layers']} Wan2.1-14B layers at dp{dp}", "",
             f"Merged with `python -m bench multi-gpu merge {' '.join(args.raw_files)}"
             f"{' --serve ' + ' '.join(args.serve) if args.serve else ''} --tag {args.tag}`; "
             f"each raw file is one device call (`run` command inside).", ""]
    if c:
        lines += [f"AllGather bus bandwidth {c[0]['allgather_busbw_bps'] / 1e9:.1f} GB/s (block-sized, in place); "
                  "pinned H2D from every device at once " + ", ".join(f"{r['concurrent_h2d_bps'] / 1e9:.1f}" for r in c) + " GB/s.", ""]
    lines += ["| workload | mode | single ms (median) | n, min-max | wave ms | wave efficiency | x resident | host us/block "
              "| peak device GB (rank 0) |", "|---|---|---|---|---|---|---|---|---|"]
    for w, single in s["single_seconds"].items():
        for m, t in single.items():
            sp = (s.get("single_spread") or {}).get(w, {}).get(m)
            n = "" if not sp else f"{sp['n']}, {sp['min'] * 1e3:.1f}-{sp['max'] * 1e3:.1f}"
            wave = s["wave_seconds"][w].get(m)
            eff = s["wave_scaling_efficiency"][w][dp].get(m)
            xr = s["over_resident"].get(w, {}).get(m)
            hu = s["host_us_per_block"][m].get(w)
            peak = s["memory"][m]["peak_device_bytes_per_rank"][0] / 1e9
            lines.append(f"| {w} | {m} | {t * 1e3:.1f} | {n} | {'' if wave is None else f'{wave * 1e3:.1f}'} | "
                         f"{'' if eff is None else f'{eff:.3f}'} | {'' if xr is None else f'{xr:.3f}'} | "
                         f"{'' if hu is None else f'{hu:.0f}'} | {peak:.2f} |")
    lines += [""]
    for k in ("allgather_single_over_rank_local_image", "allgather_single_over_bound_image", "allgather_bound_seconds_image",
              "sha256_equal", "graph_equals_eager", "serve_wave_throughput_over_single", "first_request_over_warm",
              "shutdown_seconds"):
        if k in s:
            lines.append(f"- `{k}`: {s[k]}")
    lines += ["", "Memory per mode (per rank: pinned host bytes, anonymous growth at load; page-cache growth on the node):", ""]
    for m, v in s["memory"].items():
        lines.append(f"- {m} ({v['weights_source']}): pinned {[round(x / 1e9, 2) for x in v['host_pinned_bytes_per_rank']]} GB, "
                     f"anon growth {[round(x / 1e9, 2) for x in v['anon_growth_bytes_per_rank']]} GB, "
                     f"peak device {[round(x / 1e9, 2) for x in v['peak_device_bytes_per_rank']]} GB")
    if s["policy"]:
        lines += ["", "Policy (`dlo calibrate`, then `dlo plan` for the 40-block model on this node with a 24 GiB "
                  "device, where resident cannot fit) vs the measured winner (rank-local on ties within 5%):", ""]
        for k, v in s["policy"].items():
            lines.append(f"- {k}: measured {v['measured_winner']} (" + ", ".join(f"{m} {t:.1f} ms" for m, t in v["measured_ms"].items()) + "), "
                         f"plan {v['plan']} ({'match' if v['match'] else 'MISMATCH'}): {v['reason']}; "
                         f"on this node as is: {(v['on_this_node'] or {}).get('mode')}")
    return "\n".join(lines) + "\n"
