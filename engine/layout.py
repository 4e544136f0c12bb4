"""Block layout and shard math (docs/contracts.md section 4). Pure: no torch, no I/O.

Per block, every tensor sits at a 256-byte aligned offset of one flat byte buffer (mixed dtypes
allowed). A shard group of g ranks cuts that buffer into g equal shards of S bytes,
S = ceil(nbytes / g) rounded up to 256; rank r owns bytes [r*S, (r+1)*S). The device slot holds
g*S bytes; the tail past `nbytes` is zero padding.

Owns: `BlockLayout` (offsets of a block's tensors) and the shard arithmetic.
Must never: import torch or do I/O (the agent and operator reach it through `dlo.engine.blocks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dlo.engine.checkpoint import DTYPE_SIZES

ALIGN = 256


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class TensorPlace:
    """A tensor's place in its block's flat buffer."""

    name: str
    dtype: str  # safetensors dtype name (the dtype the model computes in)
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class BlockLayout:
    tensors: tuple[TensorPlace, ...]
    nbytes: int  # end of the last tensor, rounded up to ALIGN

    def shard_bytes(self, g: int) -> int:
        return shard_bytes(self.nbytes, g)


def latent_tokens(width: int, height: int, frames: int, n: int, size_multiple: int, temporal_factor: int) -> int:
    """Transformer tokens of one call over `n` outputs of width x height x frames: one per
    size_multiple^2 pixels of each latent frame ((frames - 1) / temporal_factor + 1 of them; one for
    an images-only family, temporal_factor 0)."""
    latent_frames = (max(1, frames) - 1) // temporal_factor + 1 if temporal_factor else 1
    return n * latent_frames * (width // size_multiple) * (height // size_multiple)


def shard_bytes(nbytes: int, g: int) -> int:
    """S: the bytes each of g ranks holds of a block of `nbytes` bytes."""
    if g < 1:
        raise ValueError(f"shard group size must be >= 1, got {g}")
    return align_up(-(-nbytes // g)) if nbytes else 0


def build_layout(tensors: list[tuple[str, str, tuple[int, ...]]]) -> BlockLayout:
    """Place tensors in the given order, each at the next 256-byte aligned offset.

    Callers pass tensors in file order so that runs stay contiguous with the file where the file's
    own alignment allows (one run per dtype for a safetensors file written by safetensors).
    """
    places = []
    offset = 0
    for name, dtype, shape in tensors:
        place = TensorPlace(name, dtype, tuple(shape), offset)
        places.append(place)
        offset = align_up(place.end)
    return BlockLayout(tuple(places), offset)


@dataclass(frozen=True)
class Piece:
    """A byte range copy: tensor bytes [src, src+n) go to shard bytes [dst, dst+n)."""

    name: str
    src: int  # offset inside the tensor's bytes
    dst: int  # offset inside the shard
    n: int


def shard_pieces(layout: BlockLayout, g: int, r: int) -> list[Piece]:
    """What rank r of g must copy into its shard: the pieces of tensors that overlap it."""
    if not 0 <= r < g:
        raise ValueError(f"rank {r} outside shard group of {g}")
    s = layout.shard_bytes(g)
    lo, hi = r * s, (r + 1) * s
    pieces = []
    for t in layout.tensors:
        a, b = max(lo, t.offset), min(hi, t.end)
        if a < b:
            pieces.append(Piece(t.name, a - t.offset, a - lo, b - a))
    return pieces
