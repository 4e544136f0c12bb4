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

The tiling rule: the plain decode unless (a) it does not fit the budget beside the leanest placement
(rank-local, no resident block: the mode-independent reference) - then requests stay plain up to
the largest threshold at which no plain decode needs more than the largest request does with every
decode tiled (`plain_below`: the peak, and so the mode and the resident blocks, are what all tiled
gives; on one H200 with Wan2.1-14B and the default limits, 2,891,519 decoded pixels: images up to
two of 1024x1024 decode in one pass, not in tiles; videos, whose decoded pixels count every frame,
still tile) - or (b) the family decodes images
only, a tiled decode has a lower peak, and the budget cannot hold every block resident with the
plain one: image requests are copy-bound (measured on one H200 at 1024x1024: Qwen-Image 15.8 s
against a 14.9 s copy bound, Flux.1-dev ~0.18 s of compute per step against ~0.46 s of copies), so
every block the plain decode displaces costs a copy on each transformer call, against a decode
once per request (Qwen-Image 1024x1024, tiled: +0.43 s measured). Video requests are not: Wan2.1
streams every block at 832x480x17 within 2% of resident (bench/NOTES.md section 9), so a video
family tiles only when the plain decode does not fit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping

from dlo.plan.memory_model import PipelineMemory, format_gb
from dlo.plan.resident import VAE_TILE_ABOVE_PIXELS, ResidentPlan

# The whole-pipeline check of the calibration (bench/results/memory-h200-2026-12-01.md): a whole
# call, uncapped, reserved up to 1.076x its largest part (the cache keeps what the denoise loop
# freed; a capped allocator releases it). 10% of the request covers that.
AUTO_MARGIN_RATIO = 0.10
# Without a measured request the policy keeps this share of the budget for it (its DEVICE_RESERVE_RATIO).
UNMEASURED_RESERVE_RATIO = 0.15


def margin_bytes(request_bytes: int) -> int:
    return math.ceil(AUTO_MARGIN_RATIO * request_bytes)


def tiling_for_budget(memory: PipelineMemory, budget: int) -> tuple[int, str]:
    """(decoded pixels above which the VAE tiles, why) for a deployment under `budget`."""
    plain = dataclasses.replace(memory, tile_above_pixels=VAE_TILE_ABOVE_PIXELS)
    lean = plain.rank("rank-local")
    if lean.request_bytes is None:
        return VAE_TILE_ABOVE_PIXELS, f"the fixed rule: {lean.unmeasured}"
    need = lean.weights_bytes + lean.request_bytes + margin_bytes(lean.request_bytes)
    tiled = dataclasses.replace(memory, tile_above_pixels=0).rank("rank-local")
    assert tiled.request_bytes is not None  # the same table: measured when the plain one is
    if need > budget:
        if tiled.request_bytes >= lean.request_bytes:
            return VAE_TILE_ABOVE_PIXELS, (f"the fixed rule: the plain decode does not fit the budget of "
                                           f"{format_gb(budget)} and a tiled one needs no less")
        below = plain_below(memory, tiled.request_bytes)
        if below:
            return below, (f"plain up to {below} decoded pixels, tiled above: the plain decode of the largest "
                           f"request does not fit the budget of {format_gb(budget)} ({lean.describe()} + margin); "
                           f"below that none outgrows the largest request tiled ({tiled.describe()})")
        return 0, (f"every decode tiled: the plain decode does not fit the budget of {format_gb(budget)} "
                   f"({lean.describe()} + margin)")
    streamed = sum(m.blocks * m.largest_block_bytes for m in memory.transformers.values())
    if (memory.geometry.temporal_factor == 0 and tiled.request_bytes < lean.request_bytes
            and budget - need < streamed):
        return 0, (f"every decode tiled: image requests are copy-bound and the plain decode "
                   f"({format_gb(lean.request_bytes)}) would displace resident blocks "
                   f"(tiled: {format_gb(tiled.request_bytes)})")
    return VAE_TILE_ABOVE_PIXELS, "the plain decode fits the budget"


def plain_below(memory: PipelineMemory, request_bytes: int) -> int:
    """The largest threshold (decoded pixels, below the fixed rule's) at which no plain decode it
    leaves needs more than `request_bytes`, the largest request's peak with every decode tiled: so
    the deployment's peak, and the resident blocks planned beside it, are what every decode tiled
    gives, in every mode (the request's needs do not depend on the mode). 0: none is plain."""
    def fits(threshold: int) -> bool:
        need = dataclasses.replace(memory, tile_above_pixels=threshold).rank("rank-local").request_bytes
        return need is not None and need <= request_bytes

    low, high = 0, VAE_TILE_ABOVE_PIXELS  # fits(low); the search keeps it so (the bound grows with it)
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
