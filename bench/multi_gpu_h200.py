"""Multi-GPU validation of the weights path: pooled host links, waves, graphs, memory, policy.

One device call = one `run` (ends well inside 8 minutes at 16 Wan2.1-14B layers on 2 H200s):

    python bench/multi_gpu_h200.py run --layers 16 --dp 2 --raw $OUT/raw-a.json
    python bench/multi_gpu_h200.py run --layers 16 --dp 2 --modes allgather --raw $OUT/raw-b.json
    python bench/multi_gpu_h200.py merge bench/results/raw-h200x2-*.json --tag h200x2-2026-11-30
    python bench/multi_gpu_h200.py run --tiny --device cpu --dp 2 --layers 3 --raw /tmp/raw.json  # dry run

`run` writes the checkpoint once (on the GPU, seeded), measures the in-place AllGather bus bandwidth
and concurrent pinned H2D, then per mode starts ONE group of dp ranks (one process per device)
that loads the model once and runs both workloads:
- wave: every rank its own request at once (seed 1 + rank);
- single: rank 0 computes (seed 1), the others take part in its gathers only (`gather_only`);
- host time per block: the first 8 block hooks of a call issued after a synchronise (median);
- SHA256 of rank 0's seed-1 output, peak device memory, pinned/registered bytes, anonymous growth.
Modes: resident, rank-local, allgather (transfers as CUDA graphs) and allgather-eager (graphs off:
the graph/eager bit-identity check). `--policy` also runs `dlo calibrate` and `dlo plan` per
workload. `merge` joins raw files into the record `<tag>.{json,md,png}` with its `summary`.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends are set for every process).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_ranks as br  # noqa: E402  (NVLink multicast off for this process and its ranks)
import wan_bench as wb  # noqa: E402

MODES = ("resident", "rank-local", "allgather", "allgather-eager")
TOKENS = {"image": 4096, "video": 32760}
ITERS = {"image": 7, "video": 3}
NEAR_TIE = 0.05


def _meminfo_kb(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def rank_collectives(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """In-place AllGather bus bandwidth (block-sized) and pinned H2D from every device at once."""
    import torch
    import torch.distributed as dist

    dev = br.init(rank, world, port, args.device)
    nbytes = args.block_bytes
    shard = -(-nbytes // world)
    buf = torch.empty(shard * world, dtype=torch.uint8, device=dev)
    mine = buf.narrow(0, rank * shard, shard)
    t = statistics.median(br.timed(lambda: dist.all_gather_into_tensor(buf, mine), dev, 10)[0])
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=(dev.type == "cuda"))
    host.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    th = statistics.median(br.timed(lambda: dst.copy_(host, non_blocking=True), dev, 10)[0])
    half = host.narrow(0, 0, shard)
    th_half = statistics.median(br.timed(lambda: dst.narrow(0, 0, shard).copy_(half, non_blocking=True), dev, 10)[0])
    res = {"allgather_seconds": t, "allgather_busbw_bps": (world - 1) / world * shard * world / t,
           "concurrent_h2d_bps": nbytes / th, "shard_h2d_seconds": th_half, "block_h2d_seconds": th}
    br.gather_results(res, world, rank, out)
    br.leave(rank)


def _host_us_per_block(m, call, dev) -> float | None:
    """Median host time between the first 8 block hooks of a call issued after a synchronise."""
    import torch

    blocks = [mod for name, mod in m.module.named_children() if isinstance(mod, torch.nn.ModuleList)]
    if not blocks:
        return None
    stamps: list[float] = []
    handles = [b.register_forward_pre_hook(lambda *_: stamps.append(time.perf_counter()))
               for b in blocks[0][:9]]
    try:
        br.sync(dev)
        call()
        br.sync(dev)
    finally:
        for h in handles:
            h.remove()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return statistics.median(gaps) * 1e6 if gaps else None


def rank_mode(rank: int, world: int, port: int, args: argparse.Namespace, mode: str, out: str) -> None:
    import torch

    from dlo.engine import OffloadSettings, load

    dev = br.init(rank, world, port, args.device)
    engine_mode = "allgather" if mode.startswith("allgather") else mode
    anon0 = wb.smaps_rollup().get("Anonymous", 0)
    cached0 = _meminfo_kb("Cached") * 1024
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    br.barrier()
    t0 = time.perf_counter()
    settings = OffloadSettings(engine_mode, transfer_graphs=False if mode == "allgather-eager" else None)
    m = load(args.ckpt, settings=settings, device=dev)
    br.sync(dev)
    br.barrier()
    if rank == 0:
        print(f"  [{mode}] loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    res: dict = {
        "rank": rank, "load_seconds": time.perf_counter() - t0, "report": m.report.to_dict(),
        "anon_growth_bytes": wb.smaps_rollup().get("Anonymous", 0) - anon0,
        "page_cache_growth_bytes": _meminfo_kb("Cached") * 1024 - cached0,
        "load_peak_device_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        "workloads": {},
    }
    workloads = ["image"] if mode == "allgather-eager" else args.workloads.split(",")
    for w in workloads:
        mine = wb.make_inputs(w, str(dev), tiny=args.tiny, seed=1 + rank)
        ref = wb.make_inputs(w, str(dev), tiny=args.tiny, seed=1)

        def call(inputs=mine):
            with torch.no_grad():
                return m.module(**inputs)[0]

        def single():
            if rank == 0:
                return call(ref)
            m.gather_only(1)

        iters = 2 if args.tiny else ITERS[w]
        wait0, calls = m.stats().gather_wait_seconds, iters + 1
        waves = [] if mode == "allgather-eager" else br.timed(call, dev, iters)[0]
        wait = (m.stats().gather_wait_seconds - wait0) / calls
        singles = br.timed(single, dev, iters)[0]
        host_us = _host_us_per_block(m, (lambda: call(ref)) if rank == 0 else (lambda: m.gather_only(1)), dev)
        out_ref = call(ref) if rank == 0 else None
        if rank != 0:
            m.gather_only(1)
        br.sync(dev)
        if rank == 0:
            print(f"  [{mode}] {w} done", flush=True)
        res["workloads"][w] = {
            "wave_seconds": statistics.median(waves) if waves else None, "wave_all": waves,
            "single_seconds": statistics.median(singles), "single_all": singles,
            "gather_wait_seconds_per_call": wait, "host_us_per_block": host_us,
            "sha256_seed1": wb.sha256_of(out_ref) if out_ref is not None else None,
            "peak_device_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        }
    br.gather_results(res, world, rank, out)
    m.close()
    br.leave(rank)


def plan_profiles(device: str, tmp: Path) -> tuple[dict, dict[str, Path]]:
    """`dlo calibrate` here, then two NodeProfile files under `tmp`: this node with the measured
    bandwidths (`node`) and the same node with a 24 GiB device (`24GiB`, where a 40-layer Wan2.1-14B
    cannot be resident, so the plan chooses between the offload modes). Returns (the calibration
    fragment, {name: profile file}); RuntimeError when calibrate fails."""
    from dlo.plan.profile import CalibrationFragment, apply_calibration
    from dlo.agent.topology import local_profile

    tmp.mkdir(parents=True, exist_ok=True)
    cal = tmp / "calibration.json"
    proc = br.dlo("calibrate", "--out", str(cal), "--device", device)
    if proc.returncode:
        raise RuntimeError(f"dlo calibrate failed: {proc.stderr[-400:]}")
    profile = apply_calibration(local_profile(), CalibrationFragment.model_validate_json(cal.read_text()))
    small = profile.model_copy(update={"accelerator": profile.accelerator.model_copy(
        update={"memory_bytes": 24 * 1024**3})})
    files = {}
    for name, prof in (("node", profile), ("24GiB", small)):
        files[name] = tmp / f"profile-{name}.json"
        files[name].write_text(prof.model_dump_json())
    return json.loads(cal.read_text()), files


def run_policy(args: argparse.Namespace, facts, tmp: Path) -> dict:
    """`dlo plan` per workload for the full 40-block Wan2.1-14B at dp on `plan_profiles`' two nodes."""
    try:
        calibration, profiles = plan_profiles(args.device, tmp)
    except RuntimeError as e:
        return {"error": str(e)}
    out: dict = {"calibration": calibration, "plans": {}}
    full_bytes = facts.nonblock_bytes + facts.largest_block_bytes * 40
    for name, pf in profiles.items():
        for w in args.workloads.split(","):
            proc = br.dlo("plan", "--model-bytes", str(full_bytes), "--max-block-bytes", str(facts.largest_block_bytes),
                        "--blocks", "40", "--dp", str(args.dp), "--tokens", str(64 if args.tiny else TOKENS[w]),
                        "--profile", str(pf), "--json")
            plan = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {"error": proc.stderr[-400:]}
            out["plans"][f"{name}/{w}"] = plan
    return out


def run(args: argparse.Namespace) -> None:
    wb.ensure_dlo_importable()
    sys.path.insert(0, str(wb.REPO))
    import torch

    n_dev = torch.cuda.device_count() if args.device == "cuda" else args.dp
    if args.dp > n_dev:
        raise SystemExit(f"--dp {args.dp} needs {args.dp} devices, found {n_dev}")
    t0 = time.perf_counter()
    ckpt, written, facts = wb.checkpoint_for(args.ckpt, args.layers, args.device, args.tiny)
    args.ckpt = str(ckpt)
    args.block_bytes = facts.largest_block_bytes
    tmp = Path("/tmp/dlo-multi")
    tmp.mkdir(exist_ok=True)
    result: dict = {"layers": args.layers, "dp": args.dp, "devices": n_dev, "tiny": args.tiny,
                    "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                    "model_bytes": facts.bytes, "block_bytes": facts.largest_block_bytes,
                    "nonblock_bytes": facts.nonblock_bytes, "checkpoint": written, "command": sys.argv[1:],
                    "collectives": None, "runs": {}, "seconds": {}}
    print(f"checkpoint {ckpt}: {facts.bytes / 1e9:.1f} GB, block {facts.largest_block_bytes / 1e9:.3f} GB "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.dp > 1:
        t1 = time.perf_counter()
        f = tmp / "coll.json"
        br.spawn(rank_collectives, args.dp, args, str(f))
        result["collectives"] = json.loads(f.read_text())
        result["seconds"]["collectives"] = time.perf_counter() - t1
        c = result["collectives"]
        print(f"[collectives dp={args.dp}] busbw {c[0]['allgather_busbw_bps'] / 1e9:.1f} GB/s, h2d per device "
              f"{[round(r['concurrent_h2d_bps'] / 1e9, 1) for r in c]} GB/s", flush=True)
    for mode in args.modes.split(","):
        t1 = time.perf_counter()
        f = tmp / f"run-{mode}.json"
        f.unlink(missing_ok=True)
        try:
            br.spawn(rank_mode, args.dp, args, mode, str(f))
            result["runs"][mode] = json.loads(f.read_text())
        except Exception as e:  # a mode that does not fit is a result too
            result["runs"][mode] = {"error": str(e)[-500:]}
        result["seconds"][mode] = time.perf_counter() - t1
        r = result["runs"][mode]
        if isinstance(r, list):
            print(f"[dp={args.dp} {mode}] load {r[0]['load_seconds']:.1f} s " + " ".join(
                f"{w}: wave {(v['wave_seconds'] or 0) * 1e3:.1f} ms single {v['single_seconds'] * 1e3:.1f} ms "
                f"host {v['host_us_per_block'] or 0:.0f} us/block" for w, v in r[0]["workloads"].items())
                + f" ({result['seconds'][mode]:.0f} s)", flush=True)
        else:
            print(f"[dp={args.dp} {mode}] failed: {r['error'][-200:]}", flush=True)
    if args.policy:
        t1 = time.perf_counter()
        result["policy"] = run_policy(args, facts, tmp)
        result["seconds"]["policy"] = time.perf_counter() - t1
    Path(args.raw).parent.mkdir(parents=True, exist_ok=True)
    Path(args.raw).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.raw} ({time.perf_counter() - t0:.0f} s in all)")


# ---- merge: raw files -> the record -----------------------------------------------------------


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


def merge(args: argparse.Namespace) -> None:
    raws = [json.loads(Path(p).read_text()) for p in args.raw_files]
    rec = dict(raws[0])
    rec["runs"], rec["sources"] = {}, [str(p) for p in args.raw_files]
    for r in raws:
        rec["runs"].update({k: v for k, v in r["runs"].items() if isinstance(v, list)})
        rec["collectives"] = rec.get("collectives") or r.get("collectives")
        if r.get("policy"):
            rec["policy"] = r["policy"]
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
        serves = {Path(p).stem: json.loads(Path(p).read_text()) for p in args.serve}
        rec["serve"] = serves
        s["serve_runs"] = {k: {**v.get("summary", {}), "command": v.get("command")} for k, v in serves.items()}
        s["serve_wave_throughput_over_single"] = {}
        for name, v in serves.items():
            for mode, ratio in (v.get("summary", {}).get("wave_throughput_over_single") or {}).items():
                s["serve_wave_throughput_over_single"].setdefault(mode, {"ratio": ratio, "run": name})
        s["first_request_over_warm"] = {k: v.get("first_request_over_warm") for k, v in s["serve_runs"].items()}
        s["shutdown_seconds"] = {k: v.get("shutdown_seconds") for k, v in s["serve_runs"].items()}
    rec["summary"] = s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.tag}.json").write_text(json.dumps(rec, indent=1))
    md = _markdown(rec, args)
    (out / f"{args.tag}.md").write_text(md)
    _plot(rec, out / f"{args.tag}.png")
    print(md)


def _markdown(rec: dict, args: argparse.Namespace) -> str:
    s, dp = rec["summary"], str(rec["dp"])
    c = rec.get("collectives") or []
    lines = [f"# {rec['devices']} x {rec['device_name']}: {rec['layers']} Wan2.1-14B layers at dp{dp}", "",
             f"Merged with `python bench/multi_gpu_h200.py merge {' '.join(args.raw_files)}"
             f"{' --serve ' + ' '.join(args.serve) if args.serve else ''} --tag {args.tag}`; "
             f"each raw file is one device call (`run` command inside).", ""]
    if c:
        lines += [f"AllGather bus bandwidth {c[0]['allgather_busbw_bps'] / 1e9:.1f} GB/s (block-sized, in place); "
                  "pinned H2D from every device at once " + ", ".join(f"{r['concurrent_h2d_bps'] / 1e9:.1f}" for r in c) + " GB/s.", ""]
    lines += ["| workload | mode | single ms | wave ms | wave efficiency | x resident | host us/block | peak device GB (rank 0) |",
              "|---|---|---|---|---|---|---|---|"]
    for w, single in s["single_seconds"].items():
        for m, t in single.items():
            wave = s["wave_seconds"][w].get(m)
            eff = s["wave_scaling_efficiency"][w][dp].get(m)
            xr = s["over_resident"].get(w, {}).get(m)
            hu = s["host_us_per_block"][m].get(w)
            peak = s["memory"][m]["peak_device_bytes_per_rank"][0] / 1e9
            lines.append(f"| {w} | {m} | {t * 1e3:.1f} | {'' if wave is None else f'{wave * 1e3:.1f}'} | "
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


def _plot(rec: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (pip install -e .[bench])")
        return
    s = rec["summary"]
    ws = list(s["single_seconds"])
    fig, axes = plt.subplots(1, len(ws), figsize=(6 * len(ws), 4))
    axes = axes if len(ws) > 1 else [axes]
    for ax, w in zip(axes, ws):
        modes = list(s["single_seconds"][w])
        x = range(len(modes))
        ax.bar([i - 0.2 for i in x], [s["single_seconds"][w][m] * 1e3 for m in modes], 0.4, label="single request")
        ax.bar([i + 0.2 for i in x], [(s["wave_seconds"][w].get(m) or 0) * 1e3 for m in modes], 0.4,
               label=f"wave of {rec['dp']}")
        if w == "image" and "allgather_bound_seconds_image" in s:
            ax.axhline(s["allgather_bound_seconds_image"] * 1e3, color="k", ls="--", lw=1, label="allgather bound")
        ax.set_xticks(list(x), modes)
        ax.set_ylabel("ms per transformer call")
        ax.set_title(f"{w} ({TOKENS[w]} tokens), {rec['layers']} layers, dp{rec['dp']}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one device call: checkpoint once, collectives, one rank group per mode")
    r.add_argument("--layers", type=int, default=16)
    r.add_argument("--dp", type=int, default=2)
    r.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    r.add_argument("--workloads", default="image,video")
    r.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    r.add_argument("--tiny", action="store_true", help="tiny dimensions (CPU dry run)")
    r.add_argument("--policy", action="store_true", help="also run dlo calibrate and dlo plan per workload")
    r.add_argument("--ckpt", default=None)
    r.add_argument("--raw", required=True, help="raw JSON to write")
    m = sub.add_parser("merge", help="raw files -> <tag>.{json,md,png}")
    m.add_argument("raw_files", nargs="+")
    m.add_argument("--tag", required=True)
    m.add_argument("--serve", nargs="*", default=None, help="raw JSON of serve runs (bench/serve_h200.py)")
    m.add_argument("--out", default="bench/results")
    args = ap.parse_args()
    run(args) if args.cmd == "run" else merge(args)


if __name__ == "__main__":
    main()
