"""Measure pinned host-to-device and AllGather bandwidth on this node; write a profile fragment.
With `--peaks MODEL_DIR`: measure the model's decodes and transformer calls on this device instead
(`dlo.engine.peaks`).

The fragment is JSON with the `NodeProfile` fields `h2d_bandwidth_bps` (one device's pinned copy
rate) and `collective_bandwidth_bps` (AllGather bus bandwidth over --ranks local ranks, the
nccl/hccl/gloo backend the engine uses); the agent marks bandwidths from it as measured. On a
CPU-only host the copy is host-to-host and the collective runs over gloo.

`--peaks` measures the decodes and transformer calls a deployment of the model plans with (at the limits given as
`dlo serve` takes them) and writes them where `dlo serve` reads them (`dlo.plan.measured`), with a
line per shape: measured against what the table predicted.

Owns: the `dlo calibrate` subcommand, its two bandwidth measurements, and `--peaks`' run.
Must never: import the serving side (`dlo.serving`), or report a bandwidth it did not measure.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from dlo.cli.args import existing_dir, existing_file, positive_int

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="write the JSON fragment here (default: stdout)")
    parser.add_argument("--device", choices=("auto", "cuda", "npu", "cpu"), default="auto")
    parser.add_argument("--ranks", type=positive_int, default=None,
                        help="ranks for the AllGather measurement (default: device count, 2 on cpu; 1 skips it)")
    parser.add_argument("--mib", type=positive_int, default=256, help="buffer size per measurement, MiB")
    parser.add_argument("--iters", type=positive_int, default=5, help="timed repetitions (best one counts)")
    peaks = parser.add_argument_group("peaks", "the decodes and transformer calls of one model measured on this device (cuda)")
    peaks.add_argument("--peaks", type=existing_dir, default=None, metavar="MODEL_DIR",
                       help="measure this pipeline's decodes and transformer calls at its limits and cache them for dlo serve "
                            "(unset: the bandwidths)%(default).0s")
    peaks.add_argument("--limits", type=existing_file, default=None,
                       help="the limits file dlo serve gets (unset: its defaults)%(default).0s")
    peaks.add_argument("--max-size", type=positive_int, default=None,
                       help="dlo serve's --max-size (unset: the limits')%(default).0s")
    peaks.add_argument("--deadline", type=positive_int, default=300, help="seconds the measuring may take")


def _best(fn: Any, sync: Any, iters: int) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_h2d(device: str, nbytes: int, iters: int) -> int:
    """Bytes/s of a pinned host buffer copied to the device (host-to-host on cpu)."""
    import torch

    from dlo.engine.platform import get_platform

    platform = get_platform(device)
    dev = platform.device(0)
    host = torch.empty(nbytes, dtype=torch.uint8)
    host.fill_(1)
    pinned = platform.pin(host)
    target = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    try:
        seconds = _best(lambda: target.copy_(host, non_blocking=True), platform.synchronize, iters)
    finally:
        if pinned:
            platform.unpin(host)
    log.info("h2d device=%s bytes=%d pinned=%s seconds=%.4f", dev, nbytes, pinned, seconds)
    return int(nbytes / seconds)


def _gather_rank(rank: int, world: int, port: int, device: str, nbytes: int, iters: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from dlo.engine.platform import get_platform

    platform = get_platform(device)
    dev = platform.device(rank)
    dist.init_process_group(platform.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        shard = nbytes // world
        buf = torch.zeros(shard * world, dtype=torch.uint8, device=dev)
        mine = buf.narrow(0, rank * shard, shard)
        # the name the engine uses: all_gather_single on torch >= 2.13, all_gather_into_tensor before
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        seconds = _best(lambda: gather(buf, mine), platform.synchronize, iters)
        t = torch.tensor([seconds], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            # bus bandwidth: each rank receives (world - 1) shards
            out.put(int(shard * (world - 1) / t.item()))
    finally:
        dist.destroy_process_group()


def measure_allgather(device: str, world: int, nbytes: int, iters: int) -> int:
    import torch.multiprocessing as mp

    from dlo.engine.ports import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gather_rank, args=(r, world, port, device, nbytes, iters, queue)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    failed = [i for i, p in enumerate(procs) if p.exitcode != 0]
    if failed:
        for p in procs:
            p.kill()
        raise RuntimeError(f"AllGather measurement failed on ranks {failed}")
    return int(queue.get(timeout=10))


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    from dlo.engine.devices import device_count, resolve_device

    device = resolve_device(args.device)
    if args.peaks is not None:
        return peaks_main(args, device)
    world = args.ranks or (device_count(device) if device != "cpu" else 2)
    nbytes = args.mib * 2**20
    fragment: dict[str, int] = {"h2d_bandwidth_bps": measure_h2d(device, nbytes, args.iters)}
    if world > 1:
        fragment["collective_bandwidth_bps"] = measure_allgather(device, world, nbytes, args.iters)
    text = json.dumps(fragment, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
        log.info("wrote %s", args.out)
    else:
        print(text)
    return 0


def peaks_main(args: argparse.Namespace, device: str) -> int:
    """`dlo calibrate --peaks MODEL_DIR`: measure, cache, and say how the table compared."""
    from dlo.plan.budget import deployment_memory
    from dlo.plan.limits import Limits

    if device != "cuda":
        print(f"dlo calibrate: --peaks needs a cuda device (--device resolved to {device})", file=sys.stderr)
        return 2
    try:
        limits = Limits.load(args.limits, max_width=args.max_size, max_height=args.max_size)
    except (OSError, ValueError) as e:
        print(f"dlo calibrate: --limits {args.limits}: {e}", file=sys.stderr)
        return 2
    model_dir = args.peaks.resolve()
    _, path, lines = calibrate_peaks(model_dir, deployment_memory(model_dir, limits), args.deadline,
                                    refresh=True)
    for line in lines:
        print(line)
    if path is None:
        return 1  # measured and printed, not cached (said above)
    log.info("wrote %s", path)
    return 0


def calibrate_peaks(model_dir: Path, memory: Any, deadline_s: float, device: str = "cuda:0",
                    old: Any = None, refresh: bool = False, extra: list | None = None) -> tuple[Any, Path | None, list[str]]:
    """Measure the decodes and transformer calls `memory` (`model_dir`'s pipeline at its limits)
    weighs on `device` that its cached peaks lack (`refresh`: all of them again), add them to those
    (`old`: as already read, or new and empty; else read here; `dlo.plan.measured`), and return (the peaks now known,
    the file they are cached in - None where it could not be written: they serve this start all the
    same - and a line per measured shape against the table)."""
    from dlo.engine.peaks import device_name, library_versions, measurable, measure_peaks, unservable
    from dlo.plan.measured import MeasuredPeaks, describe, load_peaks, model_digest, peaks_path, save_peaks
    from dlo.plan.peak_values import measured_bound

    if refresh or old is None:  # who the peaks are of: read once (a start passes them to each call)
        name, versions = device_name(device), library_versions()
        fresh = MeasuredPeaks(name, versions, model_digest(model_dir))
        old = fresh if refresh else load_peaks(model_dir, name, versions) or fresh
    shapes = list(dict.fromkeys([*memory.calibration_shapes(), *(extra or [])]))  # `extra`: a start's default requests
    missing = [p for p in measurable(model_dir, shapes) if p not in old.points and not unservable(*p, old.points)
               and not (p[0].endswith("_tiled") and measured_bound(*p, old.points) is not None)]  # tiled: a bound will do
    if not missing:  # every shape the plan weighs measured already: nothing loaded, nothing written
        return old, peaks_path(model_dir, old.device, old.versions), []
    points, seconds = measure_peaks(model_dir, missing, device, deadline_s, memory.bounds.max_sequence_length,
                                    known=old.points)
    peaks = old.merged(points, seconds)
    try:
        path: Path | None = save_peaks(model_dir, peaks)
    except OSError as e:  # kept for this start all the same: the next one measures them again
        log.warning("peaks measured but not cached (%s): the next start measures them again", e)
        path = None
    predicted = {key: memory.predicted(*key, table_only=True) for key in points}
    return peaks, path, describe(points, predicted)
