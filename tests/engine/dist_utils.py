"""Run a function on N gloo ranks in fresh processes (test helper, not a test module)."""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, results: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results[rank] = ("ok", fn(rank, world, *args))
    except BaseException:  # report every failure to the parent, then fail the rank
        results[rank] = ("error", traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 300) -> list[Any]:
    """Run fn(rank, world, *args) on `world` gloo ranks; return each rank's result."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, results)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
                raise TimeoutError(f"rank {procs.index(p)} did not finish in {timeout}s")
        out = dict(results)
    errors = [f"rank {r}:\n{v[1]}" for r, v in sorted(out.items()) if v[0] == "error"]
    assert not errors, "\n".join(errors)
    assert sorted(out) == list(range(world)), f"ranks without a result: {set(range(world)) - set(out)}"
    return [out[r][1] for r in range(world)]
