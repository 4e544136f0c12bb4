"""What the multi-process GPU benchmarks share: a rank group, its barriers and timing, the `dlo` CLI.

Owns: `spawn` (one process per rank on a free port of `dlo.engine.ports`), `init` (a rank's device
and process group, plus the gloo group that barriers and results go through: `host_group`), `barrier`, `sync`,
`timed` (per-iteration wall seconds between barriers, the warm-up call's apart, keeping the last output), `gather_results`
(rank 0 writes every rank's dict), `leave` (bounded, then exit) and `dlo` (the CLI in a
subprocess). Importing it turns NVLink multicast off for this process and every rank it spawns
(`_env.multicast_off`).
Must never: hold a benchmark's own measurements (those stay in `multi_gpu.py`, `sp.py`,
`hsdp_ranks.py`), or talk to the engine's communicator outside the engine (barriers and results
use the gloo group, so the accelerator communicator carries the engine's gathers only, in the
engine's order, as in serving).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

from bench import _env

_env.multicast_off()  # before torch or NCCL is imported, here and in every rank spawned from here

HANG_S = 150  # a rank group that has not finished a mode by then is stuck: dump stacks and exit
_HOST_GROUP = None  # the gloo group of `init`


def spawn(fn: Callable[..., None], world: int, *args: Any) -> None:
    """Run `fn(rank, world, port, *args)` in `world` spawned processes; returns when all have exited."""
    import torch.multiprocessing as mp

    from dlo.engine.ports import free_port

    mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, start_method="spawn", join=True)


def init(rank: int, world: int, port: int, device_kind: str) -> Any:
    """This rank's device and process group (nccl on cuda, gloo on cpu), and the gloo group."""
    import faulthandler

    import torch
    import torch.distributed as dist

    global _HOST_GROUP
    # A hang dumps every thread's stack (stderr) instead of eating the device call in silence.
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_kind == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        # As `dlo serve` does: no device_id (the communicator is made by the engine's first gather).
        dist.init_process_group("nccl", rank=rank, world_size=world)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    _HOST_GROUP = dist.new_group(backend="gloo")
    return dev


def host_group() -> Any:
    """The gloo group of `init` (for a benchmark's own host-side messages)."""
    return _HOST_GROUP


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier(group=_HOST_GROUP)


def sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Timed(NamedTuple):
    times: list[float]  # the timed calls' wall seconds
    out: Any  # the last call's output
    first: float  # the warm-up call's wall seconds (the first request, kept apart)


def timed(fn: Callable[[], Any], dev: Any, iters: int,
          after_warmup: Callable[[], None] | None = None) -> Timed:
    """One warm-up call (timed apart: the first request), `after_warmup()`, then `iters` calls, each
    between a device sync and a barrier on every rank. The compared output is one of the timed
    calls, no extra call."""
    def one() -> tuple[float, Any]:
        sync(dev)
        barrier()
        t0 = time.perf_counter()
        out = fn()
        sync(dev)
        barrier()
        return time.perf_counter() - t0, out

    first, out = one()
    if after_warmup is not None:
        after_warmup()
    times = []
    for _ in range(iters):
        t, out = one()
        times.append(t)
    return Timed(times, out, first)


def gather_results(res: dict, world: int, rank: int, out: str) -> None:
    """Every rank's `res`, written by rank 0 to `out` as a JSON list in rank order."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, res, group=_HOST_GROUP)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))


def leave(rank: int) -> None:
    """Leave the group (bounded: see `leave_group`), then exit without interpreter teardown."""
    from dlo.engine.platform import leave_group

    clean = leave_group(5.0)
    if rank == 0:
        print(f"  left the process group {'cleanly' if clean else 'by timeout'}", flush=True)
    sys.stdout.flush()
    os._exit(0)


def dlo(*argv: str) -> subprocess.CompletedProcess:
    """`dlo ARGV...` in a subprocess of this interpreter (captured text)."""
    return subprocess.run([sys.executable, "-m", "dlo.cli.main", *argv], capture_output=True, text=True)
