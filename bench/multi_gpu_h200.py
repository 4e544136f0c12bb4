"""Multi-GPU validation: AllGather vs rank-local vs resident per dp, wave scaling, and the
policy's choice against the measured winner.

    python bench/multi_gpu_h200.py --layers 40 --dps 2,4,8            # on an NVLink H200 node
    python bench/multi_gpu_h200.py --tiny --device cpu --dps 2 --layers 3   # dry run (gloo)

Per dp and mode, dp ranks (one process per device, NCCL) load the model and run:
- a wave: every rank its own request at once (seed = 1 + rank);
- a single request: rank 0 computes, the others take part in its gathers only (`gather_only`).
wave_scaling_efficiency = t_single_best / t_wave, with t_single_best the fastest single-request
time of any mode on one device: dp concurrent requests are worth dp single ones when it is 1.
Also measured: in-place AllGather bus bandwidth for block-sized buffers, concurrent pinned H2D from
every device at once, peak device memory per rank, pinned bytes per node, output SHA256 across
modes and dp, and `dlo plan`'s choice from a profile calibrated on this machine.
Set NCCL_NVLS_ENABLE=0 (NVLink multicast stays off); the script sets it for every process.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import wan_bench as wb  # noqa: E402

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v
MODES = ("resident", "allgather", "rank-local")


def _init(rank: int, world: int, port: int, device_kind: str):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    return dev


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn, dev, iters: int) -> float:
    """Median wall seconds of fn across ranks (barrier before, device sync + barrier after)."""
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(iters):
        _sync(dev)
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rank_collectives(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    """AllGather bus bandwidth (block-sized, in place) and concurrent H2D from every device."""
    import torch
    import torch.distributed as dist

    dev = _init(rank, world, port, args.device)
    nbytes = args.block_bytes
    shard = -(-nbytes // world)
    buf = torch.empty(shard * world, dtype=torch.uint8, device=dev)
    mine = buf.narrow(0, rank * shard, shard)
    t = _timed(lambda: dist.all_gather_into_tensor(buf, mine), dev, args.iters)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=(dev.type == "cuda"))
    host.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    th = _timed(lambda: dst.copy_(host, non_blocking=True), dev, args.iters)
    res = {"allgather_seconds": t, "allgather_busbw_bps": (world - 1) / world * shard * world / t,
           "concurrent_h2d_bps": nbytes / th}
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def rank_modes(rank: int, world: int, port: int, args: argparse.Namespace, mode: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from dlo.engine import load

    dev = _init(rank, world, port, args.device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    m = load(args.ckpt, mode=mode, device=dev)
    ready = time.perf_counter() - t0
    res: dict = {"rank": rank, "ready_seconds": ready, "report": m.report.to_dict(), "workloads": {}}
    for w in args.workloads.split(","):
        mine = wb.make_inputs(w, str(dev), tiny=args.tiny, seed=1 + rank)
        ref = wb.make_inputs(w, str(dev), tiny=args.tiny, seed=1)

        def call(inputs=mine):
            with torch.no_grad():
                return m.module(**inputs)[0]

        wait0 = m.stats().gather_wait_seconds
        t_wave = _timed(call, dev, args.iters)
        wait = (m.stats().gather_wait_seconds - wait0) / (args.iters + 1)

        def single():
            if rank == 0:
                return call(ref)
            m.gather_only(1)

        t_single = _timed(single, dev, args.iters)
        out_ref = call(ref)
        res["workloads"][w] = {
            "wave_seconds": t_wave, "single_seconds": t_single, "gather_wait_seconds_per_call": wait,
            "sha256_seed1": wb.sha256_of(out_ref),
            "peak_device_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        }
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def spawn(fn, world: int, *args) -> None:
    import torch.multiprocessing as mp

    from tests.engine.dist_utils import free_port  # noqa: F401  (same helper as the tests)

    port = free_port()
    mp.start_processes(fn, args=(world, port, *args), nprocs=world, start_method="spawn", join=True)


def plan_choice(profile: Path, ckpt: str, dp: int, tokens: int) -> dict:
    cmd = [sys.executable, "-m", "dlo.cli.main", "plan", "--model", ckpt, "--dp", str(dp), "--tokens",
           str(tokens), "--calibration", str(profile), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        return {"error": proc.stderr[-500:]}
    plan = json.loads(proc.stdout)
    return plan["choice"] or {"mode": None, "reason": plan.get("error")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--dps", default="2,4,8")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--workloads", default="image,video")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = ap.parse_args()
    wb.ensure_dlo_importable()
    sys.path.insert(0, str(wb.REPO))
    import torch

    n_dev = torch.cuda.device_count() if args.device == "cuda" else max(int(x) for x in args.dps.split(","))
    dps = [d for d in (int(x) for x in args.dps.split(",")) if d <= n_dev]
    ckpt = args.ckpt or f"/tmp/wan14b-{args.layers}{'-tiny' if args.tiny else ''}"
    if not (Path(ckpt) / "config.json").exists():
        wb.write_wan_checkpoint(Path(ckpt), args.layers, "cuda" if args.device == "cuda" else "cpu", tiny=args.tiny)
    args.ckpt = ckpt
    from dlo.engine.families import describe

    facts = describe(ckpt)
    args.block_bytes = facts.largest_block_bytes
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"layers": args.layers, "model_bytes": facts.bytes, "block_bytes": facts.largest_block_bytes,
                    "devices": n_dev, "collectives": {}, "runs": {}}
    tmp = Path("/tmp/dlo-multi")
    tmp.mkdir(exist_ok=True)
    for dp in dps:
        f = tmp / f"coll-{dp}.json"
        spawn(rank_collectives, dp, args, str(f))
        result["collectives"][dp] = json.loads(f.read_text())
        print(f"[collectives dp={dp}] busbw {result['collectives'][dp][0]['allgather_busbw_bps'] / 1e9:.1f} GB/s, "
              f"h2d per device {[round(r['concurrent_h2d_bps'] / 1e9, 1) for r in result['collectives'][dp]]} GB/s", flush=True)
    for dp in [1] + dps:
        for mode in args.modes.split(","):
            if mode == "allgather" and dp == 1:
                continue
            f = tmp / f"run-{dp}-{mode}.json"
            f.unlink(missing_ok=True)
            try:
                spawn(rank_modes, dp, args, mode, str(f))
            except Exception as e:  # a mode that does not fit is a result too
                result["runs"][f"{dp}/{mode}"] = {"error": str(e)[-500:]}
                continue
            result["runs"][f"{dp}/{mode}"] = json.loads(f.read_text())
            r0 = result["runs"][f"{dp}/{mode}"][0]
            print(f"[dp={dp} {mode}] " + " ".join(
                f"{w}: wave {v['wave_seconds'] * 1e3:.0f} ms single {v['single_seconds'] * 1e3:.0f} ms"
                for w, v in r0["workloads"].items()), flush=True)
    summarise(result, args, out)


def summarise(result: dict, args: argparse.Namespace, out: Path) -> None:
    ws = args.workloads.split(",")
    tokens = {"image": 4096, "video": 32760}
    shas = {}
    summary: dict = {"wave_scaling_efficiency": {}, "winner": {}, "sha256_equal": True}
    for w in ws:
        singles = [r[0]["workloads"][w]["single_seconds"] for k, r in result["runs"].items()
                   if k.startswith("1/") and isinstance(r, list)]
        best_single = min(singles) if singles else None
        for key, ranks in result["runs"].items():
            if not isinstance(ranks, list):
                continue
            dp, mode = key.split("/")
            wave = max(r["workloads"][w]["wave_seconds"] for r in ranks)
            summary["wave_scaling_efficiency"].setdefault(w, {}).setdefault(dp, {})[mode] = (
                best_single / wave if best_single else None)
            shas.setdefault(w, set()).add(ranks[0]["workloads"][w]["sha256_seed1"])
            best = summary["winner"].setdefault(w, {}).get(dp)
            if best is None or wave < best[1]:
                summary["winner"][w][dp] = (mode, wave)
        summary["sha256_equal"] &= len(shas.get(w, ())) <= 1
    # the policy against the measured winner, from a profile calibrated here
    prof = Path("/tmp/dlo-multi/calibration.json")
    subprocess.run([sys.executable, "-m", "dlo.cli.main", "calibrate", "--out", str(prof), "--device", args.device],
                   capture_output=True, text=True)
    summary["policy"] = {}
    for w in ws:
        for dp, (mode, _) in summary["winner"].get(w, {}).items():
            choice = plan_choice(prof, args.ckpt, int(dp), tokens[w] if not args.tiny else 64)
            chosen = (choice.get("mode") or "").replace("_", "-")
            summary["policy"][f"{w}/dp{dp}"] = {"measured_winner": mode, "plan": chosen,
                                                 "match": chosen == mode, "reason": choice.get("reason")}
    result["summary"] = summary
    date = dt.date.today().isoformat()
    tag = f"h200x{result['devices']}-{date}" if args.device == "cuda" else f"multi-dryrun-{date}"
    (out / f"{tag}.json").write_text(json.dumps(result, indent=1, default=list))
    lines = [f"# Multi-GPU run ({date})", "", f"`python bench/multi_gpu_h200.py {' '.join(sys.argv[1:])}`", "",
             "| workload | dp | mode | wave ms | single ms | efficiency | gather wait ms/call | peak device GB |",
             "|---|---|---|---|---|---|---|---|"]
    for w in ws:
        for key, ranks in result["runs"].items():
            if not isinstance(ranks, list):
                lines.append(f"| {w} | {key} | failed: {ranks['error'][:80]} |")
                continue
            dp, mode = key.split("/")
            r = ranks[0]["workloads"][w]
            eff = summary["wave_scaling_efficiency"][w][dp][mode]
            lines.append(f"| {w} | {dp} | {mode} | {max(x['workloads'][w]['wave_seconds'] for x in ranks) * 1e3:.1f} | "
                         f"{r['single_seconds'] * 1e3:.1f} | {'' if eff is None else f'{eff:.3f}'} | "
                         f"{r['gather_wait_seconds_per_call'] * 1e3:.2f} | {(r['peak_device_bytes'] or 0) / 1e9:.2f} |")
    lines += ["", "Policy vs measured winner:", ""] + [
        f"- {k}: measured {v['measured_winner']}, plan {v['plan']} ({'match' if v['match'] else 'MISMATCH'}): {v['reason']}"
        for k, v in summary["policy"].items()]
    lines += ["", f"Outputs equal across modes and dp (SHA256): {summary['sha256_equal']}"]
    (out / f"{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
