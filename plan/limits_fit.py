"""Limits a device budget fits: derived when a deployment gives none, suggested when the ones it
gives cannot fit.

Owns: `candidates` (the limits tried, in the order the issue of exactness asks: the family's
default size kept, fewer frames first, then fewer images per request, then a smaller largest size),
`first_fitting` (the first candidates a plan accepts, with their plans), `largest_passing` (the
first that passes a check, by halving: what `dlo.plan.derive` weighs) and `largest_fitting_size`
(the largest `--max-size` a budget allows a mode).
Must never: import torch, or decide on a guess: a plan refuses only on measured figures
(`dlo.plan.deployment.plan` plans with `PipelineMemory.trusted`), so a limit is lowered only where
a measured figure does not fit.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, TypeVar

from dlo.plan.limits import Limits, sides
from dlo.plan.memory_model import Geometry, PipelineMemory

T = TypeVar("T")
FRAME_STEPS = (129, 81, 49, 33, 17)  # video frame counts tried (4k+1: Wan's temporal factor)
SIDE_STEP = 128  # the largest size lowered by this many pixels a step


def candidates(base: Limits, geometry: Geometry) -> Iterator[Limits]:
    """`base`, then lower limits: frames, then images per request, then the largest size, never
    below the default sizes (what a request without `size` gets must stay acceptable)."""
    yield base
    frames = base.max_frames
    if geometry.temporal_factor:
        for f in (s for s in FRAME_STEPS if s < base.max_frames):
            frames = f
            yield base.model_copy(update={"max_frames": f})
    n = base.max_n
    while n > 1:
        n = max(1, n // 2)
        yield base.model_copy(update={"max_frames": frames, "max_n": n})
    floor_w, floor_h = _floor(base)
    side = max(base.max_width, base.max_height)
    while side - SIDE_STEP >= max(floor_w, floor_h):
        side -= SIDE_STEP
        yield base.model_copy(update={"max_frames": frames, "max_n": n,
                                      "max_width": max(floor_w, min(side, base.max_width)),
                                      "max_height": max(floor_h, min(side, base.max_height))})


def _floor(limits: Limits) -> tuple[int, int]:
    sizes = [sides(s) for s in (limits.default_size, limits.default_video_size)]
    return max(w for w, _ in sizes), max(h for _, h in sizes)


def first_fitting(plan_for: Callable[[Limits], T], base: Limits, geometry: Geometry, refused: type[Exception],
                  count: int = 1) -> list[tuple[Limits, T]]:
    """The first `count` candidates whose plan is not `refused`, with their plans."""
    out: list[tuple[Limits, T]] = []
    for limits in candidates(base, geometry):
        try:
            out.append((limits, plan_for(limits)))
        except refused:
            continue
        if len(out) >= count:
            break
    return out


def largest_passing(check: Callable[[Limits], T], base: Limits, geometry: Geometry,
                    refused: type[Exception]) -> tuple[Limits, T] | None:
    """The first candidate `check` passes, found by halving: each candidate asks no more of any
    dimension than the one before it, so where one passes every later one does, and a start weighs
    (and measures on the device) about log2 of the candidates, not each. None: not even the last passes."""
    order = list(candidates(base, geometry))
    found: dict[int, T] = {}

    def passes(i: int) -> bool:
        try:
            found[i] = check(order[i])
        except refused:
            return False
        return True

    if passes(0):
        return order[0], found[0]
    low, high = 0, len(order) - 1  # low fails; high is the first known to pass, once checked
    if low == high or not passes(high):
        return None
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if passes(mid) else (mid, high)
    return order[high], found[high]


def describe(limits: Limits, geometry: Geometry) -> str:
    """`1920x1920 x 81 frames x 4 images` (frames only for a video family)."""
    frames = f" x {limits.max_frames} frames" if geometry.temporal_factor else ""
    return f"{limits.max_width}x{limits.max_height}{frames} x {limits.max_n} images"


def largest_fitting_size(memory: PipelineMemory, mode: str, g: int, budget: int) -> int | None:
    """The largest `--max-size` (width and height bound, other limits kept) at which `mode` fits
    `budget` with the table's prediction; None when none does or the request is unmeasured."""
    step = memory.geometry.size_multiple
    top = max(memory.bounds.max_width, memory.bounds.max_height) // step * step
    floor = max(step, memory.geometry.smallest_side)  # below it no request is served: no size to offer
    for side in range(top, floor - 1, -step):
        bounds = dataclasses.replace(memory.bounds, max_width=min(memory.bounds.max_width, side),
                                     max_height=min(memory.bounds.max_height, side))
        peak = memory.with_bounds(bounds).rank(mode, g).peak_bytes
        if peak is None:
            return None
        if peak <= budget:
            return side
    return None
