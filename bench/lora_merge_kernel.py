"""A LoRA merge in one pass on the device (issue 29, [Note: the fused merge] in
`dlo.engine.lora.merge_kernel`): for every adapted layer shape of a Wan2.1-14B and a Flux.1-dev block,
a rank-64 adapter merged by peft's two steps (two torch ops, `two_steps`) and by the Triton kernel
(`FusedMerge`'s launch): the milliseconds a block's merges take, the HBM bytes an element they imply,
and whether the kernel gives the two steps' bytes for every shape (what the engine's bit-identity
rests on; the engine checks every kind at load all the same), also at ranks 16, 32 and 128 and on shapes
no tile fits (bit for bit: `same_bits`, where `torch.equal` holds -0 equal to 0).

    bash bench/device.sh python -m bench lora-kernel --out $OUT/raw-lora-merge-kernel.json      # one GPU, ~40 s
    python -m bench lora-kernel --dry-run --out /tmp/merge-kernel.json     # cpu, tiny shapes, a stand-in kernel
    bash bench/device.sh python -m bench lora-kernel --sweep --out $OUT/raw-lora-merge-sweep.json   # ~40 s

Each variant: the block's layers merged in turn into one scratch (as the bank does), 3 warm-ups, then
`--reps` timed blocks between CUDA events, the median kept, three ways: launched eagerly (the host's
launches can bound it), replayed from a CUDA graph (the device's own time: what a merge queued ahead
of a block's compute costs the device) and the host's time to queue it. Bytes: the kernel's merge of
each layer against the two steps' (`torch.equal`), for a factor of None (a power-of-two scale folded
into B) and 0.8. The earlier merge in row steps was measured by this file's first form
(`bench/lora_merge_steps.py` at f2f7834: `raw-lora-merge-steps-2026-12-06-{eager,graph}.json`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from bench.lib import records
from dlo.engine.lora.merge_kernel import FusedMerge, KernelShape, launch_triton, same_bits
from dlo.engine.lora.merge_steps import two_steps
from dlo.engine.lora.weights import Branch
from dlo.engine.platform import triton_modules

RANK = 64
# (out, in) of every adapted linear of one block, in the order the block runs them
BLOCKS = {
    "wan2.1-14b": [(5120, 5120)] * 8 + [(13824, 5120), (5120, 13824)],
    "flux.1-dev-double": [(3072, 3072)] * 8 + [(12288, 3072), (3072, 12288)] * 2,
}
TINY = {"tiny": [(64, 32)] * 4 + [(256, 64), (64, 256)]}
OTHER_RANKS = (16, 32, 128)  # the kernel's other ranks: bytes only, on the block's shapes
ODD_SHAPES = [(100, 200), (1, 64), (4097, 130), (63, 5121)]  # edges no tile fits: bytes only, rank 64
# `--sweep`: the kernel's tiles, warps and grids tried on a Wan2.1 block (the first: the engine's default);
# programs as multiples of the SMs (`sm_programs`): a persistent grid leaving SMs to the GEMMs beside it
SWEEP = [KernelShape(), KernelShape(64, 128, 4), KernelShape(64, 128, 8), KernelShape(128, 128, 4),
         KernelShape(64, 256, 4), KernelShape(64, 256, 8), KernelShape(128, 256, 8), KernelShape(32, 128, 4)]
SWEEP_SM_FRACTIONS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0)


def sm_programs(device: torch.device) -> list[KernelShape]:
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return [KernelShape(programs=max(1, round(sms * f))) for f in SWEEP_SM_FRACTIONS]


def block_layers(shapes: list[tuple[int, int]], device: torch.device, gen: torch.Generator,
                 rank: int = RANK) -> list[tuple]:
    """Each layer's (weight, Branch) in bfloat16, random (never zeros: they time and compare too kindly)."""
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)

    return [(rand(o, i), Branch(rand(rank, i) * 0.05, rand(o, rank) * 0.05, None, 1.0)) for o, i in shapes]


Merge = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Any], None]


def merge_block(layers: list[tuple], out: torch.Tensor, factor, merge: Merge) -> None:
    for w, b in layers:
        merge(out[:w.numel()].view(w.shape), w, b.B, b.A, factor)


def time_block(layers: list[tuple], out: torch.Tensor, factor, merge: Merge, reps: int,
               device: torch.device) -> float:
    """Median milliseconds of one block's merges, launched eagerly."""
    for _ in range(3):
        merge_block(layers, out, factor, merge)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            merge_block(layers, out, factor, merge)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            merge_block(layers, out, factor, merge)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_block_graph(layers: list[tuple], out: torch.Tensor, factor, merge: Merge, reps: int) -> float:
    """Median milliseconds of one block's merges replayed from a CUDA graph: the device's own time,
    without the host's launches."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            merge_block(layers, out, factor, merge)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        merge_block(layers, out, factor, merge)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


def host_ms(layers: list[tuple], out: torch.Tensor, factor, merge: Merge, reps: int) -> float:
    """Median host milliseconds to queue one block's merges (no wait for the device)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        merge_block(layers, out, factor, merge)
        times.append((time.perf_counter() - t0) * 1e3)
        if out.device.type == "cuda":
            torch.cuda.synchronize()
    return statistics.median(times)


def differing_layers(layers: list[tuple], factor, launch: Merge) -> list[str]:
    """The layers (as "OUTxIN") whose merge by `launch` differs from the two steps' merge."""
    bad = []
    for w, b in layers:
        want = torch.empty_like(w)
        two_steps(want, w, b.B, b.A, factor)
        got = torch.full_like(w, float("nan"))
        launch(got, w, b.B, b.A, factor)
        if not same_bits(want, got):
            bad.append("x".join(map(str, w.shape)))
    return bad


def measure(name: str, shapes: list[tuple[int, int]], args: argparse.Namespace, device: torch.device,
            launch: Merge) -> dict:
    gen = torch.Generator(device=device).manual_seed(29)
    layers = block_layers(shapes, device, gen)
    out = torch.empty(max(o * i for o, i in shapes), dtype=torch.bfloat16, device=device)
    elements = sum(o * i for o, i in shapes)
    rec: dict = {"shapes": ["x".join(map(str, s)) for s in shapes], "elements": elements, "variants": {}}
    for way, merge in (("torch", two_steps), ("fused", launch)):
        for factor in (None, 0.8):
            ms = time_block(layers, out, factor, merge, args.reps, device)
            graph_ms = time_block_graph(layers, out, factor, merge, args.reps) if device.type == "cuda" else None
            key = f"{way}_factor_{factor}"
            v = rec["variants"][key] = {
                "way": way, "factor": factor, "ms_per_block": round(ms, 4),
                "graph_ms_per_block": None if graph_ms is None else round(graph_ms, 4),
                "host_ms_per_block": round(host_ms(layers, out, factor, merge, args.reps), 4),
                # the HBM bandwidth a block's merges would need at 4 (W read, sum written) and 8 bytes an element
                "gb_s_at_4_bytes": round(4 * elements / (graph_ms or ms) / 1e6, 1),
                "gb_s_at_8_bytes": round(8 * elements / (graph_ms or ms) / 1e6, 1),
                "differs_from_two_steps": differing_layers(layers, factor, merge) if way == "fused" else [],
            }
            print(f"{name:20s} {key:20s} {ms:8.3f} ms/block  graph {v['graph_ms_per_block']} ms  host "
                  f"{v['host_ms_per_block']} ms  device GB/s at 4 B/el {v['gb_s_at_4_bytes']}, at 8 "
                  f"{v['gb_s_at_8_bytes']}  differs: {v['differs_from_two_steps']}", flush=True)
    del layers, out
    rec["other_ranks_differ"] = {}
    for rank in OTHER_RANKS if device.type == "cuda" else ():
        layers = block_layers(shapes, device, gen, rank)
        rec["other_ranks_differ"][str(rank)] = {str(f): differing_layers(layers, f, launch) for f in (None, 0.8)}
        print(f"{name:20s} rank {rank}: differs {rec['other_ranks_differ'][str(rank)]}", flush=True)
        del layers
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def sweep(shapes: list[tuple[int, int]], args: argparse.Namespace, device: torch.device) -> dict:
    """Each kernel shape's device time for one block's merges (CUDA graph) and its bytes against the
    two steps'; `launch` on cpu (the dry run: the two steps stand in, every shape the same)."""
    layers = block_layers(shapes, device, torch.Generator(device=device).manual_seed(31))
    out = torch.empty(max(o * i for o, i in shapes), dtype=torch.bfloat16, device=device)
    elements = sum(o * i for o, i in shapes)
    rec = {}
    for shape in SWEEP + (sm_programs(device) if device.type == "cuda" else []):
        launch = ((lambda o, w, B, A, f, s=shape: launch_triton(o, w, B, A, f, s)) if device.type == "cuda"
                  else two_steps)
        key = f"{shape.rows}x{shape.cols}_w{shape.warps}_p{shape.programs or 'tiles'}"
        try:
            ms = (time_block_graph(layers, out, None, launch, args.reps) if device.type == "cuda"
                  else time_block(layers, out, None, launch, args.reps, device))
            rec[key] = {"ms_per_block": round(ms, 4), "gb_s_at_4_bytes": round(4 * elements / ms / 1e6, 1),
                        "differs_from_two_steps": {str(f): differing_layers(layers, f, launch) for f in (None, 0.8)}}
        except Exception as e:  # a shape that does not compile (registers, shared memory) is a row too
            rec[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"sweep {key:24s} {rec[key]}", flush=True)
    return rec


def odd_shapes(device: torch.device, launch: Merge) -> dict:
    """The layers (as "OUTxIN") of shapes no tile fits whose merge by `launch` differs from the two steps'."""
    layers = block_layers(ODD_SHAPES, device, torch.Generator(device=device).manual_seed(7))
    return {str(f): differing_layers(layers, f, launch) for f in (None, 0.8)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench lora-kernel", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the raw record (JSON)")
    ap.add_argument("--reps", type=int, default=20, help="timed blocks per variant (the median counts)")
    ap.add_argument("--dry-run", action="store_true", help="cpu, tiny shapes, the two steps as a stand-in kernel")
    ap.add_argument("--sweep", action="store_true",
                    help="only the kernel's tiles, warps and grids on a Wan2.1 block (device time and bytes)")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and FusedMerge.on(device) is None:
        print("no Triton on this machine: nothing to compare", file=sys.stderr)
        return 2
    launch = FusedMerge.on(device).launch if device.type == "cuda" else two_steps
    rec: dict = records.raw("lora-kernel", device.type, {
        "rank": RANK, "triton": getattr((triton_modules() or [None])[0], "__version__", None), "blocks": {}})
    if args.sweep:
        name, shapes = next(iter((TINY if args.dry_run else BLOCKS).items()))
        rec["sweep"] = {"block": name, "shapes": sweep(shapes, args, device)}
        records.write(rec, args.out)
        return 0
    for name, shapes in (TINY if args.dry_run else BLOCKS).items():
        rec["blocks"][name] = measure(name, shapes, args, device, launch)
        records.write(rec, args.out)
    rec["odd_shapes_differ"] = odd_shapes(device, launch)
    print(f"odd shapes {ODD_SHAPES}: differ {rec['odd_shapes_differ']}", flush=True)
    records.write(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
