"""What measured peaks say of shapes not measured themselves: bounds by dominance.

Owns: `AtLeast` (an int: the bytes a shape was refused at when it ran out of the device's memory),
which `dlo.plan.measured` writes and reads (`"at_least": true`) and `dlo.plan.memory_model` keeps out
of its fits between measured shapes (the true need is unknown), and `measured_bound`: a shape that
covers one which ran out of memory does not fit either; a shape covered by one measured needs no
more than it did. "Covers": the same kind (video or image), at least as many frames, at least as many
pixels in all (images x width x height) and, for a video, a frame at least as large - what a
decode's and a transformer call's memory grows with.
Must never: import anything of dlo (both of its readers import it), or bound a shape by one of the
other kind (a video decodes in chunks of frames: an image batch says nothing of it).
"""

from __future__ import annotations

from typing import Any, Mapping


class AtLeast(int):
    """A need known only from below: the shape ran out of the device's memory (this many bytes)."""

    def __repr__(self) -> str:
        return f"AtLeast({int(self)})"


def covers(big: Any, small: Any) -> bool:
    """Whether shape `big` asks at least as much as `small` of every dimension a peak grows with."""
    video = big.frames > 1
    return (video == (small.frames > 1) and big.frames >= small.frames
            and big.batch * big.width * big.height >= small.batch * small.width * small.height
            and (not video or big.width * big.height >= small.width * small.height))


def measured_bound(part: str, shape: Any, measured: Mapping[tuple[str, Any], int]) -> int | None:
    """`part`'s need at `shape` as the measured peaks bound it: `AtLeast` where it covers a shape that
    ran out of memory; else the least measured need of the shapes covering it; None: neither."""
    out_of_memory = [b for (p, s), b in measured.items() if p == part and isinstance(b, AtLeast) and covers(shape, s)]
    if out_of_memory:
        return max(out_of_memory)
    above = [b for (p, s), b in measured.items() if p == part and not isinstance(b, AtLeast) and covers(s, shape)]
    return min(above) if above else None
