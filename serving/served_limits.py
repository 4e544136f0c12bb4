"""The limits a server serves: loaded from `dlo serve`'s flags and file, checked against the model's
family at start, and the request defaults under them.

A request that omits `num_inference_steps`, `size`, or both `seconds` and `num_frames` gets the
limits' default (`default_steps`, `default_size` or `default_video_size`, 4 s of video at least the
model's shortest clip) clamped to the limits: never a 400 for a field the client did not send. A
size keeps the default's aspect ratio, scaled down to fit `max_width` x `max_height` in multiples of
the family's size multiple (at least its smallest side); frames become the longest valid count of
the family (Wan 4k+1) within `max_frames`. What a client does send is checked as sent
(`dlo.serving.api_models`).
Owns: `load_limits` (`LimitsError`: one line naming the flag or file), `limits_problem` (limits
no request could honour: a size limit or default that is not a multiple of the family's size
multiple or below its smallest side, `max_steps` below its fewest steps, `max_frames` below its
shortest clip), `default_steps`, `default_size`, `default_frames`.
Must never: import torch, or clamp what a request asked for explicitly.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from dlo.engine.families import PipelineFacts
from dlo.plan.derive import default_frames  # served here: what a video request without frames gets
from dlo.plan.limits import SMALL, Limits, sides



class LimitsError(ValueError):
    """Limits that cannot be read, or that no request of this model could honour: one line."""


def load_limits(path: Path | None, small: bool, max_steps: int | None, max_size: int | None,
                facts: PipelineFacts) -> Limits:
    """The limits of `dlo serve` (`--limits FILE`, `--small-limits`, `--max-steps`, `--max-size`),
    checked against the model (`limits_problem`)."""
    def source(field: str) -> str:  # what set this limit: its flag, else the file or the profile
        flag = {"max_steps": ("--max-steps", max_steps), "max_width": ("--max-size", max_size),
                "max_height": ("--max-size", max_size)}.get(field, ("", None))
        if flag[1] is not None:
            return f"{flag[0]} {flag[1]}"
        return f"--limits {path}" if path is not None else "--small-limits" if small else "the built-in limits"

    try:
        limits = Limits.load(path, SMALL if small else None, max_steps=max_steps, max_width=max_size,
                             max_height=max_size)
    except FileNotFoundError:
        raise LimitsError(f"--limits {path}: no such file") from None
    except IsADirectoryError:
        raise LimitsError(f"--limits {path}: not a file (a folder)") from None
    except OSError as e:
        raise LimitsError(f"--limits {path}: {e.strerror or e}") from None
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(x) for x in first.get("loc", ()))
        raise LimitsError(f"{source(field)}: {field or 'limits'}: {first.get('msg')}"
                          + (f" (got {first['input']!r})" if field and "input" in first else "")) from None
    except Exception as e:  # JSON or YAML that does not parse, or is no mapping
        raise LimitsError(f"--limits {path}: not a JSON or YAML mapping of limits: {' '.join(str(e).split())}") from None
    problem = limits_problem(facts, limits)
    if problem is not None:
        raise LimitsError(f"{source(problem[0])}: {problem[1]}")
    return limits


def limits_problem(facts: PipelineFacts, limits: Limits) -> tuple[str, str] | None:
    """(the limit's name, why) for limits no request of this model could honour, or None."""
    mult, least, model = facts.size_multiple, facts.smallest_side, facts.pipeline_class
    for name in ("max_width", "max_height"):
        value = getattr(limits, name)
        if value % mult:
            lower = value // mult * mult
            fits = f"{lower} or {lower + mult}" if lower >= least else f"{max(least, lower + mult)}"
            return name, (f"{name} {value} is not a multiple of {mult} ({model} sizes are multiples of {mult}): "
                          f"use {fits}")
        if value < least:
            return name, f"{name} {value} is below {least}, the smallest side {model} runs"
    defaults = [("default_size", limits.default_size)] if facts.images else []
    defaults += [("default_video_size", limits.default_video_size)] if facts.supports_video else []
    for name, text in defaults:
        w, h = sides(text)
        if w % mult or h % mult or w < least or h < least:
            return name, (f"{name} {text}: width and height must be multiples of {mult} of at least {least} "
                          f"for {model}")
    if limits.max_steps < facts.min_steps:
        return "max_steps", f"max_steps {limits.max_steps} is below {facts.min_steps}, the fewest steps {model} runs"
    if facts.supports_video and not facts.images:  # a model of videos only: its shortest clip must fit
        frames = default_frames(facts, limits, facts.fps or limits.video_fps)
        if facts.frames_error(frames) is not None:
            return "max_frames", (f"max_frames {limits.max_frames} is below {facts.min_frames} frames, the "
                                  f"shortest clip {model} makes")
    return None


def default_steps(facts: PipelineFacts, limits: Limits) -> int:
    """`num_inference_steps` of a request without one: `default_steps`, at most `max_steps`."""
    return max(facts.min_steps, min(limits.default_steps, limits.max_steps))


def default_size(facts: PipelineFacts, limits: Limits, video: bool = False) -> tuple[int, int]:
    """The size of a request without one: the limits' default (`default_video_size` for a video),
    scaled down in its aspect ratio to fit `max_width` x `max_height` in multiples of the family's
    size multiple, at least its smallest side."""
    w, h = sides(limits.default_video_size if video else limits.default_size)
    mult, least = facts.size_multiple, facts.smallest_side
    top_w, top_h = limits.max_width // mult * mult, limits.max_height // mult * mult
    scale = min(1.0, top_w / w, top_h / h)

    def side(n: int, top: int) -> int:
        return min(top, max(least, round(n * scale / mult) * mult))

    return side(w, top_w), side(h, top_h)


