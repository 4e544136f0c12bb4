"""Single-GPU offload benchmark: DLO against resident, diffusers group offloading and sequential
offload, on a Wan2.1-14B-shaped transformer, at the physical bound.

    python bench/offload_h200.py --layers 8            # iterate
    python bench/offload_h200.py --layers 40 --out bench/results   # the record
    python bench/offload_h200.py --tiny --device cpu --layers 3     # dry run on a laptop

Each system runs in its own subprocess (one system's pinned memory never sits beside another's).
bound = sum_i max(t_i, bytes_i / B_h2d) + t_nonblock, with t_i each block's resident time (CUDA
events), t_nonblock the rest of the resident call and B_h2d the pinned H2D bandwidth measured in
the same run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _env  # noqa: E402
import wan_bench as wb  # noqa: E402

SYSTEMS = {
    "resident": "whole model on the device (compute reference)",
    "dlo_rank_local_registered": "DLO rank-local, weights DMA'd from the registered page cache (no arena)",
    "dlo_rank_local_arena": "DLO rank-local, weights from one pinned arena",
    "dlo_allgather": "DLO allgather over a world-1 NCCL group (collective path cost)",
    "dlo_resident_blocks": "DLO rank-local registered + K blocks resident (--resident-blocks; spread evenly since the 8l-spread run, the first K before)",
    "dlo_rank_local_untimed": "DLO rank-local registered without gather-wait timing events",
    "dlo_rank_local_eager": "DLO rank-local registered, transfers launched eagerly (no CUDA graphs)",
    "dlo_allgather_eager": "DLO allgather world 1, transfers launched eagerly (no CUDA graphs)",
    "diffusers_block_stream": "diffusers group offloading block_level, use_stream=True",
    "diffusers_leaf_stream": "diffusers group offloading leaf_level, use_stream=True",
    "diffusers_block_stream_record": "diffusers block_level, use_stream + record_stream + low_cpu_mem_usage",
    "sequential": "accelerate sequential CPU offload (cpu_offload)",
}
DEFAULT_SYSTEMS = [
    "resident", "dlo_rank_local_registered", "dlo_rank_local_arena", "dlo_allgather",
    "diffusers_block_stream", "diffusers_leaf_stream", "sequential",
]


# ------------------------------------------------------------------------------------ child side
def _build(system: str, ckpt: str, device: str, resident_blocks: int):
    import torch

    from dlo.engine import OffloadSettings, load

    if system == "resident":
        return load(ckpt, settings=OffloadSettings("resident"), device=device), None
    if system.startswith("dlo_"):
        kw = {}
        if system.startswith("dlo_allgather"):
            import torch.distributed as dist

            port = 29500 + os.getpid() % 1000
            dist.init_process_group(
                "nccl" if device.startswith("cuda") else "gloo", rank=0, world_size=1,
                init_method=f"tcp://127.0.0.1:{port}",
            )
            mode = "allgather"
        else:
            mode = "rank-local"
            kw["weights"] = "arena" if system == "dlo_rank_local_arena" else "auto"
        if system == "dlo_resident_blocks":
            kw["resident_blocks"] = resident_blocks
        if system == "dlo_rank_local_untimed":
            kw["time_waits"] = False
        if system.endswith("_eager"):
            kw["transfer_graphs"] = False
        m = load(ckpt, settings=OffloadSettings(mode, **kw), device=device)
        return m, m.prefetcher
    import diffusers

    model = diffusers.WanTransformer3DModel.from_pretrained(ckpt, torch_dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    dev = torch.device(device)
    if system == "diffusers_block_stream":
        model.enable_group_offload(dev, offload_type="block_level", num_blocks_per_group=1, use_stream=True)
    elif system == "diffusers_leaf_stream":
        model.enable_group_offload(dev, offload_type="leaf_level", use_stream=True)
    elif system == "diffusers_block_stream_record":
        model.enable_group_offload(dev, offload_type="block_level", num_blocks_per_group=1, use_stream=True,
                                   record_stream=True, low_cpu_mem_usage=True)
    elif system == "sequential":
        from accelerate import cpu_offload

        cpu_offload(model, execution_device=dev)
    else:
        raise SystemExit(f"unknown system {system}")

    class _Wrap:
        module = model
        report = None

    return _Wrap(), None


def _instrument_host(pipe) -> dict:
    """Host time spent in the DLO hooks, per block (before + after).

    Once the host runs far enough ahead of a saturated GPU, any CUDA call blocks on the full launch
    queue, wherever it happens to be: the first blocks of a call issued after a synchronise show
    the hooks' own cost; the rest include that back-pressure.
    """
    acc = {"s": 0.0, "n": 0, "per_block": []}
    before, after = pipe.before_block, pipe.after_block

    def b(i):
        t0 = time.perf_counter()
        before(i)
        dt = time.perf_counter() - t0
        acc["s"] += dt
        acc["n"] += 1
        acc["per_block"].append(dt)

    def a():
        t0 = time.perf_counter()
        after()
        dt = time.perf_counter() - t0
        acc["s"] += dt
        acc["per_block"][-1] += dt

    pipe.before_block, pipe.after_block = b, a
    return acc


def _per_block_times(module, call, device: str) -> list[float]:
    """Each block's time in one call (CUDA events around every block)."""
    import torch

    blocks = list(module.blocks)
    evs = []
    handles = []
    for blk in blocks:
        pair = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)] if device.startswith("cuda") else [None, None]
        evs.append(pair)
        if pair[0] is not None:
            handles.append(blk.register_forward_pre_hook(lambda m, a, p=pair: p[0].record()))
            handles.append(blk.register_forward_hook(lambda m, a, o, p=pair: p[1].record()))
    call()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    for h in handles:
        h.remove()
    return [p[0].elapsed_time(p[1]) if p[0] is not None else float("nan") for p in evs]


def child(args: argparse.Namespace) -> None:
    wb.ensure_dlo_importable()
    import torch

    device = args.device
    if device.startswith("cuda"):
        torch.cuda.init()
        torch.zeros(1, device=device)
    base = wb.smaps_rollup()
    t0 = time.perf_counter()
    model, pipe = _build(args.child, args.ckpt, device, args.resident_blocks)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    ready = time.perf_counter() - t0
    loaded = wb.smaps_rollup()
    timer = wb.Timer(device)
    res: dict = {
        "system": args.child,
        "ready_seconds": ready,
        "rss_anon_growth_bytes": loaded.get("Rss", 0) - loaded.get("Rss_File", 0) - (base.get("Rss", 0) - base.get("Rss_File", 0)) if "Rss_File" in loaded else None,
        "pss_anon_growth_bytes": loaded.get("Pss_Anon", 0) - base.get("Pss_Anon", 0),
        "pss_bytes": loaded.get("Pss", 0),
        "pss_file_bytes": loaded.get("Pss_File", 0),
        "report": model.report.to_dict() if getattr(model, "report", None) is not None else None,
        "workloads": {},
    }
    if args.child == "resident" and device.startswith("cuda"):
        res["h2d_bandwidth_bps"] = wb.h2d_bandwidth(device)
    iters = args.iters if args.child != "sequential" else max(1, args.iters // 3)
    for w in args.workloads.split(","):
        inputs = wb.make_inputs(w, device, tiny=args.tiny)

        def call():
            with torch.no_grad():
                return model.module(**inputs)[0]

        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        med, times, out = wb.median_ms(timer, call, 1 if args.child == "sequential" else 2, iters)
        entry = {
            "call_ms": med,
            "times_ms": times,
            "sha256": wb.sha256_of(out),
            "finite": bool(torch.isfinite(out.float()).all()),
            "peak_device_bytes": torch.cuda.max_memory_allocated() if device.startswith("cuda") else None,
        }
        if args.child == "resident":
            entry["block_ms"] = _per_block_times(model.module, call, device)
        if pipe is not None:
            acc = _instrument_host(pipe)
            timer(call)
            entry["host_overhead_us_per_block"] = acc["s"] / max(1, acc["n"]) * 1e6
            first = sorted(acc["per_block"][:8])
            entry["host_overhead_us_first8_median"] = first[len(first) // 2] * 1e6 if first else None
            entry["host_overhead_us_per_block_list"] = [round(x * 1e6, 1) for x in acc["per_block"]]
            st = model.stats()
            entry["gather_wait_seconds_total"] = st.gather_wait_seconds
            entry["gathers"] = st.gathers
            pipe.before_block, pipe.after_block = type(pipe).before_block.__get__(pipe), type(pipe).after_block.__get__(pipe)
        res["workloads"][w] = entry
        del inputs, out
    res["rss_after_bytes"] = wb.smaps_rollup().get("Rss", 0)
    Path(args.result).write_text(json.dumps(res))


# ----------------------------------------------------------------------------------- parent side
def block_bytes(ckpt: str) -> list[int]:
    from dlo.engine.checkpoint import Checkpoint
    from dlo.engine.blocks import block_layout, group_keys
    from dlo.engine.families import BLOCK_FAMILIES

    ck = Checkpoint(ckpt)
    blocks, _ = group_keys(set(ck.tensors), BLOCK_FAMILIES["wan"])
    return [block_layout(ck, b).nbytes for b in blocks]


def summarise(results: dict, bbytes: list[int], model_bytes: int, layers: int) -> dict:
    res = results["resident"]
    bw = res.get("h2d_bandwidth_bps") or float("nan")
    summary: dict = {"layers": layers, "model_bytes": model_bytes, "h2d_bandwidth_bps": bw, "systems": {}}
    for w, rw in res["workloads"].items():
        t = rw["block_ms"]
        nonblock = rw["call_ms"] - sum(t)
        bound = sum(max(ti, b / bw * 1e3) for ti, b in zip(t, bbytes)) + nonblock
        summary[f"{w}_resident_ms"] = rw["call_ms"]
        summary[f"{w}_bound_ms"] = bound
        summary[f"{w}_copy_bound_ms"] = sum(bbytes) / bw * 1e3
        summary[f"{w}_resident_block_ms_median"] = sorted(t)[len(t) // 2]
    for name, r in results.items():
        s = {"ready_seconds": r["ready_seconds"], "pss_anon_growth_bytes": r["pss_anon_growth_bytes"],
             "report": r["report"], "workloads": {}}
        for w, rw in r["workloads"].items():
            s["workloads"][w] = {
                "call_ms": rw["call_ms"],
                "ms_per_block": rw["call_ms"] / layers,
                "over_resident": rw["call_ms"] / summary[f"{w}_resident_ms"],
                "over_bound": rw["call_ms"] / summary[f"{w}_bound_ms"],
                "peak_device_bytes": rw["peak_device_bytes"],
                "bit_equal_resident": rw["sha256"] == res["workloads"][w]["sha256"],
                "finite": rw["finite"],
                "host_overhead_us_per_block": rw.get("host_overhead_us_per_block"),
                "host_overhead_us_first8_median": rw.get("host_overhead_us_first8_median"),
            }
        summary["systems"][name] = s
    # headline keys (issue contract): the best DLO system is "dlo"
    dlo_names = [n for n in results if n.startswith("dlo_") and n not in ("dlo_resident_blocks", "dlo_rank_local_untimed")]
    summary["dlo_systems"] = dlo_names
    for w in res["workloads"]:
        best = min(dlo_names, key=lambda n: summary["systems"][n]["workloads"][w]["call_ms"]) if dlo_names else None
        diff = [n for n in results if n.startswith("diffusers_")]
        bestd = min(diff, key=lambda n: summary["systems"][n]["workloads"][w]["call_ms"]) if diff else None
        if best:
            sw = summary["systems"][best]["workloads"][w]
            summary[f"{w}_dlo_system"] = best
            summary[f"{w}_dlo_ms"] = sw["call_ms"]
            summary[f"{w}_over_bound"] = sw["over_bound"]
            summary[f"{w}_over_resident"] = sw["over_resident"]
        if bestd:
            summary[f"{w}_diffusers_system"] = bestd
            summary[f"{w}_diffusers_ms"] = summary["systems"][bestd]["workloads"][w]["call_ms"]
    dl = [summary["systems"][n] for n in dlo_names]
    if dl:
        # the hooks' own cost: median of the first blocks after a synchronise (no back-pressure),
        # from the runs that recorded it
        first8 = [ww["host_overhead_us_first8_median"] for s in dl for ww in s["workloads"].values()
                  if ww.get("host_overhead_us_first8_median") is not None]
        summary["host_overhead_us"] = max(first8) if first8 else None
        summary["host_overhead_us_mean_with_backpressure"] = max(
            (ww["host_overhead_us_per_block"] or 0) for s in dl for ww in s["workloads"].values()
        )
    if "dlo_rank_local_arena" in results and results["dlo_rank_local_arena"]["report"]:
        summary["pinned_over_model"] = results["dlo_rank_local_arena"]["report"]["host_pinned_bytes"] / sum(bbytes)
    if "dlo_rank_local_registered" in results:
        r = results["dlo_rank_local_registered"]
        # beyond what the resident baseline's process grows by (CUDA context, libraries)
        extra = r["pss_anon_growth_bytes"] - res["pss_anon_growth_bytes"]
        summary["extra_host_bytes_over_model"] = max(0, extra) / model_bytes
        summary["ready_seconds"] = r["ready_seconds"]
        summary["weights_source"] = (r["report"] or {}).get("weights_source")
    return summary


def write_markdown(summary: dict, path: Path, meta: dict) -> None:
    lines = [f"# Single-GPU offload benchmark ({meta['date']})", "", f"Command: `{meta['command']}`", "",
             f"Machine: {meta['device_name']}, torch {meta['torch']}, diffusers {meta['diffusers']}. "
             f"Model: Wan2.1-14B dimensions, {summary['layers']} layers, random bf16 weights "
             f"({summary['model_bytes'] / 1e9:.2f} GB), page cache warm (written just before). "
             f"Pinned H2D measured: {summary['h2d_bandwidth_bps'] / 1e9:.1f} GB/s.", ""]
    for w in ("image", "video"):
        if f"{w}_resident_ms" not in summary:
            continue
        lines += [f"## {w} ({'4,096' if w == 'image' else '32,760'} tokens)", "",
                  f"resident {summary[f'{w}_resident_ms']:.1f} ms, physical bound {summary[f'{w}_bound_ms']:.1f} ms "
                  f"(copy-only bound {summary[f'{w}_copy_bound_ms']:.1f} ms)", "",
                  "| system | ms/call | ms/block | / resident | / bound | peak device GB | host us/block (first 8 / all) | bit-equal |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, s in summary["systems"].items():
            ww = s["workloads"].get(w)
            if not ww:
                continue
            hov = ww["host_overhead_us_per_block"]
            f8 = ww.get("host_overhead_us_first8_median")
            hov_s = "" if hov is None else (f"{f8:.0f} / {hov:.0f}" if f8 is not None else f"- / {hov:.0f}")
            lines.append(
                f"| {name} | {ww['call_ms']:.1f} | {ww['ms_per_block']:.2f} | {ww['over_resident']:.3f} | "
                f"{ww['over_bound']:.3f} | {(ww['peak_device_bytes'] or 0) / 1e9:.2f} | "
                f"{hov_s} | {ww['bit_equal_resident']} |")
        lines.append("")
    lines += ["## Host memory and start-up", "", "| system | ready s | weights source | host pinned GB | PSS anon growth GB |", "|---|---|---|---|---|"]
    for name, s in summary["systems"].items():
        rep = s["report"] or {}
        lines.append(f"| {name} | {s['ready_seconds']:.2f} | {rep.get('weights_source', '')} | "
                     f"{rep.get('host_pinned_bytes', 0) / 1e9:.2f} | {s['pss_anon_growth_bytes'] / 1e9:.2f} |")
    lines += ["", "Systems:", ""] + [f"- `{n}`: {SYSTEMS[n]}" for n in summary["systems"]]
    path.write_text("\n".join(lines) + "\n")


def plot(summary: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ws = [w for w in ("image", "video") if f"{w}_resident_ms" in summary]
    fig, axes = plt.subplots(1, len(ws), figsize=(7 * len(ws), 4.5))
    axes = axes if len(ws) > 1 else [axes]
    for ax, w in zip(axes, ws):
        names = list(summary["systems"])
        vals = [summary["systems"][n]["workloads"][w]["ms_per_block"] for n in names]
        ax.barh(names, vals, color=["#888" if n == "resident" else "#2a7" if n.startswith("dlo") else "#c64" for n in names])
        ax.axvline(summary[f"{w}_bound_ms"] / summary["layers"], color="k", ls="--", label="physical bound")
        ax.set_xscale("log")
        ax.set_xlabel("ms per block (log)")
        ax.set_title(f"{w}: {'4,096' if w == 'image' else '32,760'} tokens")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS))
    ap.add_argument("--workloads", default="image,video")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny dims (CPU dry run)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--ckpt", default=None, help="reuse a checkpoint folder instead of writing one")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    ap.add_argument("--tag", default=None)
    ap.add_argument("--resident-blocks", type=int, default=0)
    ap.add_argument("--merge", nargs="+", help="summarise raw result files of earlier runs (no device work)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    wb.ensure_dlo_importable()
    if args.merge:
        raws = [json.loads(Path(f).read_text()) for f in args.merge]
        results = {k: v for raw in raws for k, v in raw["results"].items()}
        return finish(results, raws[0]["block_bytes"], raws[0]["model_bytes"], raws[0]["layers"], raws[0]["meta"], Path(args.out), args.tag or raws[0]["tag"])
    _env.multicast_off()  # before torch: this process and its children
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = args.ckpt or f"/tmp/wan14b-{args.layers}{'-tiny' if args.tiny else ''}"
    if not (Path(ckpt) / "config.json").exists():
        info = wb.write_wan_checkpoint(Path(ckpt), args.layers, args.device, tiny=args.tiny)
        print(f"wrote {ckpt}: {info}", flush=True)
    bbytes = block_bytes(ckpt)
    from dlo.engine.checkpoint import Checkpoint

    model_bytes = Checkpoint(ckpt).nbytes
    results = {}
    for system in args.systems.split(","):
        rfile = Path(f"/tmp/bench-{system}.json")
        rfile.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--child", system, "--result", str(rfile), "--ckpt", ckpt,
               "--device", args.device, "--workloads", args.workloads, "--iters", str(args.iters),
               "--layers", str(args.layers), "--resident-blocks", str(args.resident_blocks)] + (["--tiny"] if args.tiny else [])
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not rfile.exists():
            print(f"[{system}] FAILED rc={proc.returncode}\n{proc.stderr[-3000:]}", flush=True)
            continue
        results[system] = json.loads(rfile.read_text())
        brief = {w: round(v["call_ms"], 2) for w, v in results[system]["workloads"].items()}
        print(f"[{system}] {time.perf_counter() - t0:.0f}s ready={results[system]['ready_seconds']:.2f}s ms={brief}", flush=True)
    import torch

    meta = {
        "date": dt.date.today().isoformat(),
        "command": "python bench/offload_h200.py " + " ".join(a for a in sys.argv[1:]),
        "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "diffusers": __import__("diffusers").__version__,
    }
    tag = args.tag or f"h200-{meta['date']}-{args.layers}l"
    raw = {"results": results, "block_bytes": bbytes, "model_bytes": model_bytes, "layers": args.layers, "meta": meta, "tag": tag}
    (out / f"raw-{tag}.json").write_text(json.dumps(raw))
    if "resident" not in results:
        print("no resident reference in this run: raw results only (summarise with --merge)")
        return
    finish(results, bbytes, model_bytes, args.layers, meta, out, tag)


def finish(results: dict, bbytes: list[int], model_bytes: int, layers: int, meta: dict, out: Path, tag: str) -> None:
    summary = summarise(results, bbytes, model_bytes, layers)
    summary["meta"] = meta
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.json").write_text(json.dumps(summary, indent=1))
    write_markdown(summary, out / f"{tag}.md", meta)
    plot(summary, out / f"{tag}.png")
    print((out / f"{tag}.md").read_text())


if __name__ == "__main__":
    main()
