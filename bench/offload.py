"""Single-GPU offload benchmark: DLO against resident, diffusers group offloading and sequential
offload, on a Wan2.1-14B-shaped transformer, at the physical bound.

    python -m bench offload run --layers 8                     # iterate
    bash bench/device.sh python -m bench offload run --layers 40 --out $OUT   # the record (one GPU)
    python -m bench offload run --tiny --device cpu --layers 3  # dry run on a laptop
    python -m bench offload merge RAW.json... --out bench/results --stem offload-DATE

Each system runs in its own subprocess (one system's pinned memory never sits beside another's).
bound = sum_i max(t_i, bytes_i / B_h2d) + t_nonblock, with t_i each block's resident time (CUDA
events), t_nonblock the rest of the resident call and B_h2d the pinned H2D bandwidth measured in
the same run. Every call's time is kept: the first (warm-up) call apart, then the median, min
and max of the timed calls; the headline is the default path (`dlo_rank_local_registered`), and
the fastest DLO variant is shown only beside it, named.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import _env
from bench import wan_bench as wb
from bench.lib import merge as merging
from bench.lib import records
from bench.lib.stats import spread
from bench.offload_systems import DEFAULT_SYSTEMS, SYSTEMS


def block_bytes(ckpt: str) -> list[int]:
    from dlo.engine.checkpoint import Checkpoint
    from dlo.engine.blocks import block_layout, group_keys
    from dlo.engine.families import BLOCK_FAMILIES

    ck = Checkpoint(ckpt)
    blocks, _ = group_keys(set(ck.tensors), BLOCK_FAMILIES["wan"])
    return [block_layout(ck, b).nbytes for b in blocks]


def call_spread(rw: dict) -> dict:
    """A system's calls of one workload: the first (warm-up) call apart, then the timed ones; records
    from before the warm-up was kept (2026-11-29) have no first."""
    times = rw.get("times_ms") or [rw["call_ms"]]
    first = rw["warmup_ms"][0] if rw.get("warmup_ms") else None
    return spread(times, first=first)


def _bound(rw: dict, bbytes: list[int], bw: float) -> float:
    t = rw["block_ms"]
    return sum(max(ti, b / bw * 1e3) for ti, b in zip(t, bbytes)) + rw["call_ms"] - sum(t)


def summarise(results: dict, bbytes: list[int], model_bytes: int, layers: int) -> dict:
    """Per workload: resident and the physical bound (both from the resident run's median call), each
    system's calls with their spread and its medians over both; the default path named, the fastest
    DLO variant beside it."""
    res = results["resident"]
    bw = res.get("h2d_bandwidth_bps") or float("nan")
    summary: dict = {"layers": layers, "model_bytes": model_bytes, "h2d_bandwidth_bps": bw, "systems": {},
                     "default_path": DEFAULT_PATH}
    for w, rw in res["workloads"].items():
        summary[w] = {"resident_ms": rw["call_ms"], "bound_ms": _bound(rw, bbytes, bw),
                      "copy_bound_ms": sum(bbytes) / bw * 1e3}
    for name, r in results.items():
        s = {"ready_seconds": r["ready_seconds"], "pss_anon_growth_bytes": r["pss_anon_growth_bytes"],
             "report": r["report"], "workloads": {}}
        for w, rw in r["workloads"].items():
            s["workloads"][w] = {
                "call_ms": call_spread(rw), "ms_per_block": rw["call_ms"] / layers,
                "over_resident": rw["call_ms"] / summary[w]["resident_ms"],
                "over_bound": rw["call_ms"] / summary[w]["bound_ms"],
                "peak_device_bytes": rw["peak_device_bytes"],
                "bit_equal_resident": rw["sha256"] == res["workloads"][w]["sha256"], "finite": rw["finite"],
                "host_overhead_us_per_block": rw.get("host_overhead_us_per_block"),
                "host_overhead_us_first8_median": rw.get("host_overhead_us_first8_median")}
        summary["systems"][name] = s
    variants = [n for n in results if n.startswith("dlo_") and n not in ("dlo_resident_blocks", "dlo_rank_local_untimed")]
    for w in res["workloads"]:
        if variants:
            summary[w]["fastest_dlo_variant"] = min(variants, key=lambda n: results[n]["workloads"][w]["call_ms"])
    if "dlo_rank_local_registered" in results and "resident" in results:
        r = results["dlo_rank_local_registered"]
        # beyond what the resident baseline's process grows by (CUDA context, libraries)
        summary["extra_host_bytes_over_model"] = max(0, r["pss_anon_growth_bytes"] - res["pss_anon_growth_bytes"]) / model_bytes
    return summary


DEFAULT_PATH = "dlo_rank_local_registered"  # one GPU: rank-local, registered page cache, graph transfers


def markdown(summary: dict, source: dict) -> str:
    prov = source["provenance"]
    lines = [f"# Single-GPU offload benchmark ({prov['date'][:10]})", "", f"Command: `{prov['command']}`", "",
             f"Card: {prov['card']['name']}; torch {prov['versions'].get('torch')}, diffusers "
             f"{prov['versions'].get('diffusers')}. Model: Wan2.1-14B dimensions, {summary['layers']} layers, random "
             f"bf16 weights ({summary['model_bytes'] / 1e9:.2f} GB), page cache warm. Pinned H2D measured: "
             f"{summary['h2d_bandwidth_bps'] / 1e9:.1f} GB/s. The default path is `{DEFAULT_PATH}`.", ""]
    for w in ("image", "video"):
        if w not in summary:
            continue
        b = summary[w]
        lines += [f"## {w} ({'4,096' if w == 'image' else '32,760'} tokens)", "",
                  f"resident {b['resident_ms']:.1f} ms, physical bound {b['bound_ms']:.1f} ms (copy-only bound "
                  f"{b['copy_bound_ms']:.1f} ms); fastest DLO variant: `{b.get('fastest_dlo_variant')}`", "",
                  "| system | ms/call median | n | min-max | first | / resident | / bound | peak device GB | bit-equal |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, s in summary["systems"].items():
            ww = s["workloads"].get(w)
            if ww:
                c = ww["call_ms"]
                first = "-" if c["first"] is None else f"{c['first']:.1f}"
                lines.append(f"| {name} | {c['median']:.1f} | {c['n']} | {c['min']:.1f}-{c['max']:.1f} | {first} | "
                             f"{ww['over_resident']:.3f} | {ww['over_bound']:.3f} | "
                             f"{(ww['peak_device_bytes'] or 0) / 1e9:.2f} | {ww['bit_equal_resident']} |")
        lines.append("")
    lines += ["## Host memory and start-up", "", "| system | ready s | weights source | host pinned GB | PSS anon growth GB |",
              "|---|---|---|---|---|"]
    for name, s in summary["systems"].items():
        rep = s["report"] or {}
        lines.append(f"| {name} | {s['ready_seconds']:.2f} | {rep.get('weights_source', '')} | "
                     f"{rep.get('host_pinned_bytes', 0) / 1e9:.2f} | {s['pss_anon_growth_bytes'] / 1e9:.2f} |")
    return "\n".join(lines + ["", "Systems:", ""] + [f"- `{n}`: {SYSTEMS[n.split('@')[0]]}" for n in summary["systems"]]) + "\n"


def run(args: argparse.Namespace) -> int:
    _env.multicast_off()  # before torch: this process and its children
    ckpt = args.ckpt or f"/tmp/wan14b-{args.layers}{'-tiny' if args.tiny else ''}"
    if not (Path(ckpt) / "config.json").exists():
        info = wb.write_wan_checkpoint(Path(ckpt), args.layers, args.device, tiny=args.tiny)
        print(f"wrote {ckpt}: {info}", flush=True)
    from dlo.engine.checkpoint import Checkpoint

    results = {}
    for system in args.systems.split(","):
        rfile = Path(f"/tmp/bench-{system}.json")
        rfile.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "bench.offload_systems", system, str(rfile), "--ckpt", ckpt,
               "--device", args.device, "--workloads", args.workloads, "--iters", str(args.iters),
               "--resident-blocks", str(args.resident_blocks)] + (["--tiny"] if args.tiny else [])
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=wb.REPO)
        if proc.returncode != 0 or not rfile.exists():
            print(f"[{system}] FAILED rc={proc.returncode}\n{proc.stderr[-3000:]}", flush=True)
            continue
        results[system] = json.loads(rfile.read_text())
        brief = {w: round(v["call_ms"], 2) for w, v in results[system]["workloads"].items()}
        print(f"[{system}] {time.perf_counter() - t0:.0f}s ready={results[system]['ready_seconds']:.2f}s ms={brief}", flush=True)
    raw = records.raw("offload", args.device, {"results": results, "block_bytes": block_bytes(ckpt),
                                              "model_bytes": Checkpoint(ckpt).nbytes, "layers": args.layers})
    records.write(raw, Path(args.raw))
    print(f"wrote {args.raw}: merge with python -m bench offload merge {args.raw} --out DIR --stem NAME")
    return 0


def merge(args: argparse.Namespace) -> int:
    sources = merging.load(args.raw_files)
    results = merging.keyed(sources, "results")
    if "resident" not in results:
        raise SystemExit("merge: no resident run among the sources (the reference every ratio divides by)")
    first = sources[0].record
    summary = summarise(results, first["block_bytes"], first["model_bytes"], first["layers"])
    prov = first.get("provenance") or legacy_provenance(first)
    rec = merging.merged("offload", sources, {"summary": summary})
    records.write(rec, Path(args.out) / f"{args.stem}.json", markdown(summary, {"provenance": prov}))
    print((Path(args.out) / f"{args.stem}.md").read_text())
    return 0


def legacy_provenance(raw: dict) -> dict:
    """A raw from before the provenance (2026-11-29): its `meta`, in provenance's shape."""
    meta = raw["meta"]
    return {"date": meta["date"], "command": meta["command"], "card": {"name": meta["device_name"]},
            "versions": {"torch": meta["torch"], "diffusers": meta["diffusers"]}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench offload", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one call: each system in its own process; writes the raw record")
    r.add_argument("--layers", type=int, default=8, help="transformer blocks of the Wan2.1-14B-shaped model")
    r.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help="comma-separated, of: " + ", ".join(SYSTEMS))
    r.add_argument("--workloads", default="image,video", help="image (4,096 tokens), video (32,760 tokens)")
    r.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    r.add_argument("--tiny", action="store_true", help="tiny dims (CPU dry run)")
    r.add_argument("--iters", type=int, default=5, help="timed calls per system and workload, after two warm-up calls")
    r.add_argument("--ckpt", default=None, help="reuse a checkpoint folder instead of writing one")
    r.add_argument("--raw", default=os.path.join(os.environ.get("OUT", "/tmp"), "raw-offload.json"),
                   help="where the raw record goes")
    r.add_argument("--resident-blocks", type=int, default=0, help="blocks kept resident by dlo_resident_blocks")
    m = sub.add_parser("merge", help="raw records of one card -> <stem>.{json,md} with the summary")
    m.add_argument("raw_files", nargs="+", help="raw records (a later file's system replaces an earlier one)")
    m.add_argument("--out", default="bench/results", help="folder of the merged record")
    m.add_argument("--stem", required=True, help="the merged record's name, e.g. offload-2026-12-07")
    args = ap.parse_args(argv)
    return run(args) if args.cmd == "run" else merge(args)


if __name__ == "__main__":
    raise SystemExit(main())
