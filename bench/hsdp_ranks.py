"""What every rank of the HSDP bench's process group runs: its phases in order, one engine each.

Owns: the phase loop (`rank_main`: per phase a hang limit, a budget decision every rank agrees on,
the phase's runs, their results gathered into rank 0's `phase-<name>.json`, the device memory freed
before the next phase), the four phases (`reference`: the resident model on rank 0 alone; `hsdp`:
FSDP2 + diffusers' Ulysses; `dlo_allgather`, `dlo_ranklocal`: `dlo.engine.load` + DLO's Ulysses),
the FSDP2 model (`fsdp_wan`) and one timed run (`timed_run`: peak device memory, rank 0's output
of the seed-1 request saved beside the results).
Must never: decide what a figure means (bench/hsdp.py summarises), or let the ranks disagree
on what runs next: every choice that changes the collective order (skip a phase, which runs, which
batches) is the same on every rank.

[Note: HSDP + Ulysses] FSDP2 shards every parameter on dim 0 over a 1-D mesh of all N ranks
(`shard`; HSDP's replicate dim is 1 inside one node, where NVLink joins every pair), one
parameter group per transformer block and one for the rest (the root), resharded after forward,
each group's pre-forward prefetching the next block's all-gather (`set_modules_to_forward_prefetch`;
the root prefetches block 0). diffusers' context parallelism runs over the (dp 1, ring 1, ulysses
N) mesh of `dlo.engine.parallel.make_groups` on the same ranks: its hooks split the sequence at
blocks.0's input and gather proj_out's output, its all-to-alls run inside attention. FSDP2's hooks
unshard a block's parameters before its forward and free them after; neither touches what the
other binds, so they compose (bit-identical to one GPU on gloo ranks, tests/test_bench_hsdp.py).
Weights are stored as the resident reference computes them (bf16; fp32 for the class's
`_keep_in_fp32_modules`), so the policy is FSDP2's default `MixedPrecisionPolicy()`: no
`param_dtype` cast, the all-gather moves the stored bytes (mixed dtypes travel as uint8) and every
GEMM sees the reference's operands. `param_dtype=bf16` (the training recipe) would round the fp32
norms; `reduce_dtype` has nothing to reduce without a backward.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from bench import ranks as br
from bench import wan_bench as wb

PHASES = ("reference", "hsdp", "dlo_allgather", "dlo_ranklocal")
DLO_MODES = {"dlo_allgather": "allgather", "dlo_ranklocal": "rank-local"}
ITERS = {"image": 5, "video": 3}  # timed calls after one warm-up; a dry run times 2
BUDGET_MARGIN = 1.25  # a phase starts only with this many times the longest phase so far left


@dataclass
class Rank:
    """This rank's place and the call's arguments (the same on every rank)."""

    rank: int
    world: int
    dev: Any
    args: Any
    work: Path  # the call's working folder: phase results and rank 0's outputs


def rank_main(rank: int, world: int, port: int, args: Any, phases: list[str], work: str) -> None:
    import torch

    dev = br.init(rank, world, port, args.device)
    if dev.type == "cpu":
        torch.set_num_threads(1)
    ctx = Rank(rank, world, dev, args, Path(work))
    took = [args.longest_phase_s]  # what phases of an earlier group took (0 in the first)
    for name in phases:
        faulthandler.dump_traceback_later(args.phase_limit_s, exit=True)  # a stuck phase ends the group
        path = ctx.work / f"phase-{name}.json"
        reason = _agreed_skip(ctx, took)
        if reason:
            if rank == 0:
                path.write_text(json.dumps({"skipped": reason}))
                print(f"[{name}] skipped: {reason}", flush=True)
            continue
        t0, host_start = time.perf_counter(), wb.smaps_rollup()
        res = _PHASE_FNS[name](ctx, name)
        res.update(rank=rank, seconds=time.perf_counter() - t0, host_start=host_start)
        br.gather_results(res, world, rank, str(path))
        took.append(time.perf_counter() - t0)
        _free_device(dev)
        if rank == 0:
            print(f"[{name}] done in {took[-1]:.0f} s", flush=True)
    faulthandler.cancel_dump_traceback_later()
    br.leave(rank)


def _agreed_skip(ctx: Rank, took: list[float]) -> str | None:
    """Rank 0's decision, the same on every rank: the reason to skip the next phase, or None."""
    import torch.distributed as dist

    left, need = ctx.args.deadline - time.time(), BUDGET_MARGIN * max(took)
    msg = [f"call budget: {left:.0f} s left, a phase took up to {max(took):.0f} s" if left <= need else None]
    dist.broadcast_object_list(msg, src=0, group=br.host_group())
    return msg[0]


def _free_device(dev: Any) -> None:
    import torch

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()


# ---- inputs and timed runs -----------------------------------------------------------------------
def batch_inputs(workload: str, dev: Any, tiny: bool, seeds: list[int]) -> dict:
    """One request per seed (`wan_bench.make_inputs`), stacked into one batch in seed order."""
    import torch

    parts = [wb.make_inputs(workload, str(dev), tiny=tiny, seed=s) for s in seeds]
    keys = ("hidden_states", "timestep", "encoder_hidden_states")
    return {**{k: torch.cat([p[k] for p in parts]) for k in keys}, "return_dict": False}


def _caller(module: Any, inputs: dict) -> Callable[[], Any]:
    import torch

    def call():
        with torch.no_grad():
            return module(**inputs)[0]

    return call


def timed_run(ctx: Rank, phase: str, key: str, fn: Callable[[], Any], requests: int,
              waits: Callable[[], float] | None = None) -> dict:
    """`ranks.timed` (one warm-up, timed apart, then timed calls between barriers) with this run's peak
    device memory; rank 0 saves sample 0 of its output (the seed-1 request) as `out-<phase>-<key>.pt`.
    `waits`: DLO's cumulative wait for weights, reported per timed call."""
    import torch

    cuda = ctx.dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(ctx.dev)
    before = torch.cuda.memory_allocated(ctx.dev) if cuda else None
    marks: list[float] = []

    def mark() -> None:
        br.sync(ctx.dev)
        marks.append(waits() if waits else 0.0)

    iters = 2 if ctx.args.dry_run else ITERS[key.split("/")[0]]
    times, out, first = br.timed(fn, ctx.dev, iters, after_warmup=mark)
    mark()
    if ctx.rank == 0 and out is not None:
        torch.save(out[:1].detach().float().cpu(), ctx.work / f"out-{phase}-{key.replace('/', '-')}.pt")
        print(f"  [{phase}] {key}: {statistics.median(times) * 1e3:.1f} ms per call, {requests} request(s)", flush=True)
    rec = {"seconds": statistics.median(times), "all": times, "first_seconds": first, "requests": requests,
           "peak_device_bytes": torch.cuda.max_memory_allocated(ctx.dev) if cuda else None,
           "allocated_before_bytes": before}
    if waits:
        rec["gather_wait_ms_per_call"] = (marks[-1] - marks[0]) / iters * 1e3
    return rec


def _dp_runs(ctx: Rank, phase: str, module: Any, waits=None) -> dict:
    """Every rank its own request at once (seed 1 + rank): a wave of N requests."""
    return {f"{w}/dp/b1": timed_run(ctx, phase, f"{w}/dp/b1",
                                    _caller(module, batch_inputs(w, ctx.dev, ctx.args.tiny, [1 + ctx.rank])),
                                    ctx.world, waits)
            for w in ctx.args.workloads.split(",")}


def _sp_runs(ctx: Rank, phase: str, module: Any, batches: list[int], waits=None) -> dict:
    """One batch of requests (seeds 1..b) on all N ranks; the image workload at every batch size."""
    out = {}
    for w in ctx.args.workloads.split(","):
        for b in (batches if w == "image" else [1]):
            key = f"{w}/sp/b{b}"
            inputs = batch_inputs(w, ctx.dev, ctx.args.tiny, list(range(1, b + 1)))
            out[key] = timed_run(ctx, phase, key, _caller(module, inputs), b, waits)
    return out


def _loaded(t0: float, dev: Any) -> dict:
    """After a load: its seconds and this rank's host memory (smaps_rollup), every rank past it."""
    br.sync(dev)
    br.barrier()
    return {"load_seconds": time.perf_counter() - t0, "host_loaded": wb.smaps_rollup()}


# ---- the phases ----------------------------------------------------------------------------------
def reference_phase(ctx: Rank, phase: str) -> dict:
    """The resident model on rank 0 alone (the others keep step at the barriers): every other
    phase's outputs are compared with these."""
    from dlo.engine import OffloadSettings, load

    t0 = time.perf_counter()
    m = load(ctx.args.ckpt, settings=OffloadSettings("resident"), device=ctx.dev) if ctx.rank == 0 else None
    res = {**_loaded(t0, ctx.dev), "runs": {}}
    for w in ctx.args.workloads.split(","):
        fn = _caller(m.module, batch_inputs(w, ctx.dev, ctx.args.tiny, [1])) if m else (lambda: None)
        res["runs"][f"{w}/one/b1"] = timed_run(ctx, phase, f"{w}/one/b1", fn, 1)
    res["host_end"] = wb.smaps_rollup()
    return res


def hsdp_phase(ctx: Rank, phase: str) -> dict:
    """FSDP2 over all N ranks: first a wave (sp 1, each rank its own request), then diffusers'
    Ulysses over the same N ranks at each batch size ([Note: HSDP + Ulysses])."""
    from dlo.engine.parallel import enable_sequence_parallel, make_groups
    from dlo.engine.settings import ParallelSettings

    t0 = time.perf_counter()
    module = fsdp_wan(ctx.args.ckpt, ctx.dev, ctx.rank, ctx.world)
    res = {**_loaded(t0, ctx.dev), "runs": _dp_runs(ctx, phase, module)}
    groups = make_groups(ParallelSettings(dp=1, sp=ctx.world), ctx.dev, gathers=False)
    enable_sequence_parallel(module, groups, ctx.dev, exchange="diffusers")
    res["runs"].update(_sp_runs(ctx, phase, module, ctx.args.hsdp_batches))
    res["host_end"] = wb.smaps_rollup()
    return res


def dlo_phase(ctx: Rank, phase: str) -> dict:
    """DLO in allgather or rank-local mode: first a wave (each rank its own request), then DLO's
    Ulysses over the same N ranks (one request)."""
    from dlo.engine import OffloadSettings, load
    from dlo.engine.parallel import enable_sequence_parallel, make_groups
    from dlo.engine.settings import ParallelSettings

    mode = DLO_MODES[phase]
    t0 = time.perf_counter()
    m = load(ctx.args.ckpt, settings=OffloadSettings(mode), device=ctx.dev)
    res = {**_loaded(t0, ctx.dev), "report": m.report.to_dict()}

    def waits() -> float:
        return m.stats().gather_wait_seconds

    res["runs"] = _dp_runs(ctx, phase, m.module, waits)
    settings = ParallelSettings(dp=1, sp=ctx.world, ulysses_exchange=ctx.args.dlo_exchange)
    groups = make_groups(settings, ctx.dev, gathers=mode == "allgather")
    enable_sequence_parallel(m.module, groups, ctx.dev)
    res["runs"].update(_sp_runs(ctx, phase, m.module, [1], waits))
    res["host_end"] = wb.smaps_rollup()
    m.close()
    return res


_PHASE_FNS = {"reference": reference_phase, "hsdp": hsdp_phase, "dlo_allgather": dlo_phase,
              "dlo_ranklocal": dlo_phase}


# ---- the FSDP2 model -----------------------------------------------------------------------------
def fsdp_wan(ckpt_dir: str, dev: Any, rank: int, world: int) -> Any:
    """The transformer of `ckpt_dir` under FSDP2 ([Note: HSDP + Ulysses]): built on meta in the
    stored dtypes, sharded, then only this rank's shard of each parameter copied to the device from
    the page cache (no full copy anywhere)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dlo.engine.checkpoint import Checkpoint
    from dlo.engine.dtypes import torch_dtype
    from dlo.engine.model import build_meta_model, set_tensor

    ckpt = Checkpoint(ckpt_dir)
    meta = build_meta_model(ckpt_dir, ckpt)
    module = meta.module
    for name, p in list(module.named_parameters()):  # meta parameters are built in the default dtype
        set_tensor(module, name, torch.empty(p.shape, dtype=torch_dtype(meta.target_dtype[name]), device="meta"))
    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("shard",))
    policy = MixedPrecisionPolicy()
    blocks = [meta.block_module(b) for b in meta.blocks]
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    fully_shard(module, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    for current, following in zip([module, *blocks], blocks):
        current.set_modules_to_forward_prefetch([following])
    buffers = dict(module.named_buffers())  # computed at build (RoPE tables); to_empty blanks them
    module.to_empty(device=dev)
    with torch.no_grad():
        for name, b in module.named_buffers():
            b.copy_(ckpt.view(name) if name in ckpt.tensors else buffers[name])
        for name, p in module.named_parameters():
            _copy_shard(name, p, ckpt.view(name), rank, world)
    ckpt.close()
    return module


def _copy_shard(name: str, param: Any, full: Any, rank: int, world: int) -> None:
    """This rank's dim-0 shard of `full` into the sharded parameter: FSDP2 chunks dim 0 as
    `torch.chunk` does, the ranks past the last chunk holding an empty one (its documented layout;
    the shape check catches any other)."""
    import torch

    chunks = torch.chunk(full, world, dim=0)
    src = chunks[rank] if rank < len(chunks) else full[:0]
    local = param.to_local()
    if tuple(local.shape) != tuple(src.shape):
        raise RuntimeError(f"{name}: FSDP2's local shard on rank {rank} is {tuple(local.shape)}, the checkpoint's "
                           f"chunk {tuple(src.shape)}: this torch does not shard as dim-0 torch.chunk; "
                           "bench/hsdp_ranks.py's loader needs updating")
    local.copy_(src)  # the checkpoint's dtype may be narrower (bf16 stored, fp32 kept): copy_ upcasts
