"""One system of the offload suite measured in its own process (`bench/offload.py` starts one per
system, so one system's pinned memory never sits beside another's).

Owns: `SYSTEMS` (each system's name and what it is), `DEFAULT_SYSTEMS`, building each one
(`build`), the host-time instrument of DLO's hooks, per-block times, and `child` (load, time every
workload: the warm-up calls kept apart from the timed ones, the output's digest, peak device
memory and host memory; written as JSON for the parent).
Must never: write a record (the parent does, with its provenance).

    python -m bench.offload_systems SYSTEM RESULT.json --ckpt DIR [--device cuda] ...
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench import wan_bench as wb

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
def build(system: str, ckpt: str, device: str, resident_blocks: int):
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
    import torch

    device = args.device
    if device.startswith("cuda"):
        torch.cuda.init()
        torch.zeros(1, device=device)
    base = wb.smaps_rollup()
    t0 = time.perf_counter()
    model, pipe = build(args.child, args.ckpt, device, args.resident_blocks)
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

        def call(inputs=inputs):
            with torch.no_grad():
                return model.module(**inputs)[0]

        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        warmup = [timer(call)[0] for _ in range(1 if args.child == "sequential" else 2)]
        med, times, out = wb.median_ms(timer, call, 0, iters)
        entry = {
            "call_ms": med,
            "warmup_ms": warmup,
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.offload_systems", description="one system, one process")
    ap.add_argument("child", choices=sorted(SYSTEMS), help="the system")
    ap.add_argument("result", help="where its JSON goes")
    ap.add_argument("--ckpt", required=True, help="the checkpoint folder")
    ap.add_argument("--device", default="cuda", help="cuda or cpu")
    ap.add_argument("--workloads", default="image,video", help="comma-separated workloads")
    ap.add_argument("--iters", type=int, default=5, help="timed calls per workload")
    ap.add_argument("--resident-blocks", type=int, default=0, help="for dlo_resident_blocks")
    ap.add_argument("--tiny", action="store_true", help="tiny dims (CPU dry run)")
    child(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
