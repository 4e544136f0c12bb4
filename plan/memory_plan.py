"""What a device budget decides before the weights are placed: the VAE tiling rule and how many
blocks `--resident-blocks auto` keeps on the device.

Owns: `AUTO_MARGIN_RATIO` (the stated margin over the largest accepted request's predicted peak),
`tiling_for_budget` (the decoded-pixel threshold above which the VAE decodes in tiles, for a
deployment: the same on every rank and in every mode, so bytes stay identical across them),
`resident_plan` (blocks per streamed model that fill what the budget leaves, with its arithmetic) and
`ResidentPlan.within` (fewer where a rank's device has less room than the budget). Read by
`dlo.plan.budget` (`dlo serve`, before any rank starts) and at load by each rank.
Must never: import torch, or size anything on a guess: with the request unmeasured (a family the
table lacks) the plan keeps the policy's reserve ratio of the budget free and says so.

The arithmetic, per deployment (budget B per rank, the memory model's `rank(mode, g, blocks)`):
    margin  = AUTO_MARGIN_RATIO x request   (request: the largest accepted request's peak, table)
    blocks  = the most resident blocks with weights(blocks) + request + margin <= B, added one at a
              time to the transformers in turn (each runs on every denoising step; Wan2.2's two
              experts alike), then to the streamed text encoders (one or two calls per request)
Within a model the kept blocks are spread through the order (`dlo.engine.offload.spread_resident`:
each resident block hides the next streamed block's copy; measured better than the first k).

The tiling rule (`--vae-tiling auto`, the default): every decode plain - the bytes of plain
diffusers - unless the plain decode of the largest accepted request does not fit the budget beside
the leanest placement (rank-local, no resident block: the mode-independent reference) by a figure
that is measured (on this device, `dlo.plan.measured`, or within the table's measured shapes): a
prediction extrapolated beyond the measured shapes never makes a decode lossy (it is stated as a
warning). Where the plain decode does not fit, requests stay plain up to the largest threshold at
which no plain decode needs more than the largest request does with every decode tiled
(`plain_below`: the peak, and so the mode and the resident blocks, are what all tiled gives).
Tiling for speed (an image request is copy-bound, and a tiled decode leaves room for resident
blocks: Qwen-Image 1024x1024 +0.43 s measured on one H200 plain) is the user's choice:
`--vae-tiling always`. `--vae-tiling never` plans as auto and the server refuses (400, naming the
size) what auto would tile. Without a device budget (cpu ranks) or for a family the table lacks,
the fixed rule (`VAE_TILE_ABOVE_PIXELS`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

from dlo.plan.memory_model import PipelineMemory, decoded_pixels, format_gb, largest_requests
from dlo.plan.resident import NO_TILING, VAE_TILE_ABOVE_PIXELS, ResidentPlan

# The whole-pipeline check of the calibration (bench/results/memory-h200-2026-12-01.md): a whole
# call, uncapped, reserved up to 1.076x its largest part (the cache keeps what the denoise loop
# freed; a capped allocator releases it). 10% of the request covers that.
AUTO_MARGIN_RATIO = 0.10
# Without a measured request the policy keeps this share of the budget for it (its DEVICE_RESERVE_RATIO).
UNMEASURED_RESERVE_RATIO = 0.15


def margin_bytes(request_bytes: int) -> int:
    return math.ceil(AUTO_MARGIN_RATIO * request_bytes)


def tiling_for_budget(memory: PipelineMemory, budget: int, tiling: str = "auto") -> tuple[int, str]:
    """(decoded pixels above which the VAE tiles, why) for a deployment under `budget`; `tiling`:
    `--vae-tiling` (auto: only where the plain decode cannot fit; always: every decode; never: as
    auto, and the server refuses what auto would tile)."""
    if tiling == "always":
        return 0, "--vae-tiling always: every decode tiled (the user's choice: not the bytes of a plain decode)"
    plain = dataclasses.replace(memory, tile_above_pixels=NO_TILING)
    lean = plain.rank("rank-local")
    if lean.request_bytes is None:
        return VAE_TILE_ABOVE_PIXELS, f"the fixed rule: {lean.unmeasured}"
    if _fits(plain.trusted().rank("rank-local"), budget):
        if not _fits(lean, budget):  # only a guess beyond the measured shapes says it does not
            return NO_TILING, (f"every decode plain: the largest request's peak is extrapolated beyond the measured "
                               f"shapes ({lean.describe()}) and may not fit the budget of {format_gb(budget)}, but a "
                               "guess never makes a decode lossy (`dlo calibrate --peaks` measures it on this device)")
        return NO_TILING, f"every decode plain: the largest fits the budget of {format_gb(budget)} ({lean.describe()})"
    below = plain_below(memory, budget)
    tiled = dataclasses.replace(memory, tile_above_pixels=below).rank("rank-local")
    if below:
        return below, (f"plain up to {below} decoded pixels, tiled above: the plain decode of the largest request "
                       f"does not fit the budget of {format_gb(budget)} ({lean.describe()} + margin); below that "
                       f"every plain decode does ({tiled.describe()})")
    return 0, (f"every decode tiled: the plain decode does not fit the budget of {format_gb(budget)} "
               f"({lean.describe()} + margin)")


def _fits(rank: Any, budget: int) -> bool:
    """Whether a rank's weights and its largest request's need and margin fit `budget`."""
    return rank.weights_bytes + rank.request_bytes + margin_bytes(rank.request_bytes) <= budget


def plain_below(memory: PipelineMemory, budget: int) -> int:
    """The largest threshold (decoded pixels, below the largest request's) at which every plain decode
    it leaves, and every tiled one above it, fits `budget` beside the leanest placement by a measured
    figure (a decode whose figure is extrapolated stays plain: a guess never makes it lossy). 0:
    none is plain."""
    def fits(threshold: int) -> bool:
        return _fits(dataclasses.replace(memory, tile_above_pixels=threshold).trusted().rank("rank-local"), budget)

    low = 0
    high = max(decoded_pixels(s) for s in largest_requests(memory.bounds, memory.geometry))
    if not fits(low):
        return 0
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def resident_plan(memory: PipelineMemory, mode: str, g: int, budget: int) -> tuple[ResidentPlan, str]:
    """The blocks `--resident-blocks auto` keeps per streamed model under `budget`, and the arithmetic
    as one log line (module docstring)."""
    base = memory.rank(mode, g, {})
    fixed, why = request_reserve(memory, mode, g, budget)

    def peak(counts: Mapping[str, int]) -> int:
        return memory.rank(mode, g, counts).weights_bytes + fixed

    counts = {name: 0 for name in (*memory.transformers, *memory.encoders)}
    if mode.replace("_", "-") != "resident":
        for group in (memory.transformers, memory.encoders):
            _fill(counts, group, peak, budget)
    placed = peak(counts)
    models = {**memory.transformers, **memory.encoders}
    per_block = {name: _block_bytes(memory, models[name].compute_block_bytes or models[name].largest_block_bytes)
                 for name in counts}
    plan = ResidentPlan(blocks=counts, block_bytes=per_block, budget_bytes=budget, spare_bytes=max(0, budget - placed),
                        encoders=tuple(memory.encoders))
    kept = ", ".join(f"{n} {counts[n]} of {models[n].blocks} ({format_gb(per_block[n])} each)" for n in counts)
    line = (f"resident_blocks=auto budget={format_gb(budget)}: weights {format_gb(base.weights_bytes)} + {why} = "
            f"{format_gb(base.weights_bytes + fixed)} with no resident block; kept {kept}; predicted peak "
            f"{format_gb(placed)}, {format_gb(plan.spare_bytes)} spare")
    return plan, line


def request_reserve(memory: PipelineMemory, mode: str, g: int, budget: int) -> tuple[int, str]:
    """(bytes a rank keeps free beside its weights for the largest accepted request and its margin,
    what they are), the same in every plan of the budget."""
    base = memory.rank(mode, g, {})
    if base.request_bytes is not None:
        request, margin = base.request_bytes, margin_bytes(base.request_bytes)
        return request + margin, (f"the largest accepted request {format_gb(request)} ({base.worst}) + margin "
                                  f"{format_gb(margin)}")
    return (math.ceil(UNMEASURED_RESERVE_RATIO * budget),
            f"{UNMEASURED_RESERVE_RATIO:.0%} of the budget kept for the request ({base.unmeasured})")


def spare_bytes(memory: PipelineMemory, mode: str, g: int, blocks: int | Mapping[str, int], budget: int) -> int:
    """What `budget` leaves after a rank's weights with `blocks` resident and `request_reserve`: the
    room an auto merge cache of LoRA adapters gets (`dlo.plan.deployment.auto_merge_cache`)."""
    fixed, _ = request_reserve(memory, mode, g, budget)
    return max(0, budget - memory.rank(mode, g, blocks).weights_bytes - fixed)


def _block_bytes(memory: PipelineMemory, block: int) -> int:
    """What one more resident block places (in the compute dtype: FP8 streaming keeps it dequantized):
    the block and the table's overhead per byte."""
    fit = memory.table.weights_overhead
    return block + (math.ceil(fit.coef[1] * block) if fit is not None and len(fit.coef) > 1 else 0)


def _fill(counts: dict[str, int], group: Mapping, peak: Callable[[Mapping[str, int]], int], budget: int) -> None:
    """One block at a time to the models of `group` in turn while the peak stays within the budget."""
    open_ = [name for name in group if group[name].blocks > 0]
    while open_:
        for name in list(open_):
            trial = {**counts, name: counts[name] + 1}
            if counts[name] >= group[name].blocks or peak(trial) > budget:
                open_.remove(name)
                continue
            counts[name] += 1


def within(plan: ResidentPlan, room: int | None) -> dict[str, int]:
    """The plan's blocks on a rank whose device has `room` bytes (None: the budget holds): where the
    room is short of the budget by more than the plan's spare, blocks go, the streamed encoders'
    first, then the transformers' in turn."""
    counts = dict(plan.blocks)
    short = (plan.budget_bytes - room - plan.spare_bytes) if room is not None else 0
    for names in ([n for n in counts if n in plan.encoders], [n for n in counts if n not in plan.encoders]):
        while short > 0 and any(counts[n] for n in names):
            for name in names:
                if short > 0 and counts[name]:
                    counts[name] -= 1
                    short -= plan.block_bytes[name]
    return counts
