"""Measure pinned host-to-device and AllGather bandwidth on this node; write a profile fragment.

The fragment is JSON with the `NodeProfile` fields `h2d_bandwidth_bps` (one device's pinned copy
rate) and `collective_bandwidth_bps` (AllGather bus bandwidth over --ranks local ranks, the
nccl/hccl/gloo backend the engine uses); the agent marks bandwidths from it as measured. On a
CPU-only host the copy is host-to-host and the collective runs over gloo.

Owns: the `dlo calibrate` subcommand and its two measurements.
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

from dlo.cli.args import positive_int

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="write the JSON fragment here (default: stdout)")
    parser.add_argument("--device", choices=("auto", "cuda", "npu", "cpu"), default="auto")
    parser.add_argument("--ranks", type=positive_int, default=None,
                        help="ranks for the AllGather measurement (default: device count, 2 on cpu; 1 skips it)")
    parser.add_argument("--mib", type=positive_int, default=256, help="buffer size per measurement, MiB")
    parser.add_argument("--iters", type=positive_int, default=5, help="timed repetitions (best one counts)")


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
