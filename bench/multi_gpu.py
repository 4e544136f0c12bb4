"""Multi-GPU validation of the weights path: pooled host links, waves, graphs, memory, policy.

One device call = one `run` (ends well inside 8 minutes at 16 Wan2.1-14B layers on 2 H200s):

    bash bench/device.sh python -m bench multi-gpu run --layers 16 --dp 2 --raw $OUT/raw-a.json
    bash bench/device.sh python -m bench multi-gpu run --layers 16 --dp 2 --modes allgather --raw $OUT/raw-b.json
    python -m bench multi-gpu merge bench/results/raw-h200x2-*.json --tag h200x2-2026-11-30
    python -m bench multi-gpu run --tiny --device cpu --dp 2 --layers 3 --raw /tmp/raw.json  # dry run

`run` writes the checkpoint once (on the GPU, seeded), measures the in-place AllGather bus bandwidth
and concurrent pinned H2D, then per mode starts ONE group of dp ranks (one process per device)
that loads the model once and runs both workloads:
- wave: every rank its own request at once (seed 1 + rank);
- single: rank 0 computes (seed 1), the others take part in its gathers only (`gather_only`);
- host time per block: the first 8 block hooks of a call issued after a synchronise (median);
- SHA256 of rank 0's seed-1 output, peak device memory, pinned/registered bytes, anonymous growth.
Modes: resident, rank-local, allgather (transfers as CUDA graphs) and allgather-eager (graphs off:
the graph/eager bit-identity check). `--policy` also runs `dlo calibrate` and `dlo plan` per
workload. `merge` joins raw files of one card into the record `<tag>.{json,md}` with its `summary`:
every figure's median with its n and min-max, the serve calls' throughput ratios each (never the
best of them alone).
NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends are set for every process).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench import ranks as br  # NVLink multicast off for this process and its ranks
from bench import wan_bench as wb
from bench.lib import records
from bench.multi_gpu_record import merge

MODES = ("resident", "rank-local", "allgather", "allgather-eager")
TOKENS = {"image": 4096, "video": 32760}
ITERS = {"image": 7, "video": 3}


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
        wave_t = None if mode == "allgather-eager" else br.timed(call, dev, iters)
        waves = wave_t.times if wave_t else []
        wait = (m.stats().gather_wait_seconds - wait0) / calls
        single_t = br.timed(single, dev, iters)
        singles = single_t.times
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
            "wave_first_seconds": wave_t.first if wave_t else None, "single_first_seconds": single_t.first,
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


def run(args: argparse.Namespace) -> int:
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
    result: dict = records.raw("multi-gpu", args.device, {
        "layers": args.layers, "dp": args.dp, "devices": n_dev, "tiny": args.tiny, "model_bytes": facts.bytes,
        "block_bytes": facts.largest_block_bytes, "nonblock_bytes": facts.nonblock_bytes, "checkpoint": written,
        "collectives": None, "runs": {}, "seconds": {}})
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
    records.write(result, Path(args.raw))
    print(f"wrote {args.raw} ({time.perf_counter() - t0:.0f} s in all)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench multi-gpu", description=__doc__.splitlines()[0])
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
    m = sub.add_parser("merge", help="raw files of one card -> <tag>.{json,md}")
    m.add_argument("raw_files", nargs="+")
    m.add_argument("--tag", required=True)
    m.add_argument("--serve", nargs="*", default=None, help="raw JSON of serve runs (python -m bench serve)")
    m.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    return run(args) if args.cmd == "run" else merge(args)


if __name__ == "__main__":
    main()
