"""Limits derived from the device budget when a deployment gives none: the largest that keep what
a user of plain diffusers gets - every weight on the device where it can stay, and the default
requests decoded plain (its bytes) - before the largest that merely fit.

Owns: `derive` (the plan at the first candidate limits (`dlo.plan.limits_fit.candidates`) that
pass, found by halving (`largest_passing`: a start measures a few limit sets, not every one), in
three passes: resident with the default requests plain (mode auto on an accelerator whose budget
holds the weights), the default requests plain, then fitting at all; the reason says which and why
the given ones did not), `default_shapes` (the default requests at a limit set) and
`default_frames` (the frames of a video request that gives none; `dlo.serving.served_limits` serves it).
Must never: import torch, or lower limits that were given (`dlo.plan.deployment.plan_folder` calls
it only when none were).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from dlo.plan.budget import DeviceBudgetError
from dlo.plan.limits import Limits, sides
from dlo.plan.limits_fit import describe, largest_passing
from dlo.plan.memory_model import Shape, decoded_pixels

DEFAULT_VIDEO_SECONDS = 4.0  # a video request without seconds or num_frames


def default_frames(facts: Any, limits: Limits, fps: int) -> int:
    """The frames of a video request without `seconds` or `num_frames`: 4 s (at least the model's
    shortest clip) at `fps`, as the family's valid count nearest it, cut to the longest valid count
    within `max_frames` (and the model's own longest)."""
    seconds = max(DEFAULT_VIDEO_SECONDS, facts.shortest_seconds(fps))
    frames = facts.valid_frames(seconds, fps)
    top = min(limits.max_frames, facts.max_frames or limits.max_frames)
    step, offset = facts.frame_step or facts.temporal_factor, facts.frame_offset
    if frames > top >= offset:
        frames = (top - offset) // step * step + offset
    return frames


def default_shapes(facts: Any, limits: Limits) -> list[Shape]:
    """The default requests at `limits`: one image of `default_size`, a video of `default_video_size`
    and `default_frames` (each where the family makes it): measured on the device with each limit
    set, and what derived limits keep plain."""
    out = [Shape(*sides(limits.default_size))] if facts.images else []
    if facts.supports_video:
        out.append(Shape(*sides(limits.default_video_size), default_frames(facts, limits, facts.fps or limits.video_fps)))
    return out


def derive(at: Callable[[Limits], Any], limits: Limits, geometry: Any, defaults: Callable[[Limits], list[Shape]],
           resident: bool) -> Any:
    """The plan at the derived limits (`at`: the plan at a candidate; `DeviceBudgetError` where it
    does not fit); `resident`: whether a resident pass may run. Raises what the given limits raise
    where no candidate fits."""
    passes = ((True, True), (False, True), (False, False)) if resident else ((False, True), (False, False))
    for keep_weights, plain in passes:
        check = _check(at, defaults, keep_weights, plain)
        fits = largest_passing(check, limits, geometry, DeviceBudgetError)
        if fits is None:
            continue
        chosen, p = fits
        if chosen == limits:
            return p
        try:
            check(limits)
            why = "they would not"
        except DeviceBudgetError as e:
            why = str(e)
        what = ("every weight stays on the device and the default requests decode plain" if keep_weights else
                "the default requests decode plain (the bytes of plain diffusers)" if plain else "the requests fit")
        line = (f"limits derived from the device budget: {describe(chosen, geometry)}, the largest at which {what} "
                f"(the defaults {describe(limits, geometry)}: {why}; --limits or --max-size accepts others)")
        return dataclasses.replace(p, reasons=(line, *p.reasons))
    return at(limits)  # raises: nothing fits


def _check(at: Callable[[Limits], Any], defaults: Callable[[Limits], list[Shape]], keep_weights: bool,
           plain: bool) -> Callable[[Limits], Any]:
    def check(candidate: Limits) -> Any:
        p = at(candidate)
        if keep_weights and p.mode != "resident":
            raise DeviceBudgetError(f"the weights would stream (mode {p.mode})")
        tiled = [s for s in defaults(candidate) if p.tiles(decoded_pixels(s))] if plain and p.vae_tiling != "always" else []
        if tiled:
            raise DeviceBudgetError(f"the default requests would decode tiled (above {p.vae_tile_above_pixels} "
                                    "decoded pixels)")
        return p
    return check
