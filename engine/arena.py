"""Host-side weights: one exact-size pinned arena per rank holding this rank's shard of every block.

Owns: sizing the arena (sum of this rank's shard bytes: S_b per offloaded block), filling it straight
from the checkpoint's page-cache views (tensor bytes to their place in the shard, zero padding in
the alignment gaps and the tail), and pinning it with ONE call (cudaHostRegister on CUDA, mlock on
CPU). Never one `pin_memory()` per tensor: PyTorch's host allocator rounds each pinned request up to
a power of two.
Must never: hold more than this rank's shard of any block, or make a temporary copy of a block.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from dlo.engine.checkpoint import Checkpoint
from dlo.engine.dtypes import torch_dtype
from dlo.engine.layout import BlockLayout, shard_pieces
from dlo.engine.platform import Platform

log = logging.getLogger(__name__)


@dataclass
class Arena:
    buffer: torch.Tensor  # uint8, exactly sum(shard bytes)
    offsets: list[int]  # offsets[i]: where offloaded block i's shard starts
    shard_sizes: list[int]
    pinned: bool

    def shard(self, i: int) -> torch.Tensor:
        off = self.offsets[i]
        return self.buffer[off : off + self.shard_sizes[i]]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


def build_arena(
    ckpt: Checkpoint,
    layouts: list[BlockLayout],
    target_dtype: dict[str, str],
    g: int,
    r: int,
    platform: Platform,
    derived: Callable[[str], torch.Tensor | None] | None = None,
) -> Arena:
    """Allocate, pin and fill rank r's arena for shard group size g (`derived`: the bytes of tensors
    the slots hold other than as stored, FP8 weights converted at load, `dlo.engine.quantize`)."""
    sizes = [lay.shard_bytes(g) for lay in layouts]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)
    buffer = torch.empty(total, dtype=torch.uint8)
    pinned = False
    if platform.name == "npu":
        buffer = buffer.pin_memory()  # one call for the whole arena (see NpuPlatform)
        pinned = True
    for i, lay in enumerate(layouts):
        _fill_shard(ckpt, lay, target_dtype, g, r, buffer[offsets[i] : offsets[i] + sizes[i]], derived)
    if platform.name != "npu":
        # Pin after filling: registration then covers pages already faulted in.
        pinned = platform.pin(buffer)
    return Arena(buffer, offsets, sizes, pinned)


def _fill_shard(
    ckpt: Checkpoint, lay: BlockLayout, target_dtype: dict[str, str], g: int, r: int, shard: torch.Tensor,
    derived: Callable[[str], torch.Tensor | None] | None = None,
) -> None:
    cursor = 0
    for piece in shard_pieces(lay, g, r):
        if piece.dst > cursor:
            shard[cursor : piece.dst].zero_()
        made = derived(piece.name) if derived is not None else None
        src = made if made is not None else _source_bytes(ckpt, lay, target_dtype, piece.name)
        shard[piece.dst : piece.dst + piece.n].copy_(src[piece.src : piece.src + piece.n])
        cursor = piece.dst + piece.n
    if cursor < shard.numel():
        shard[cursor:].zero_()


def _source_bytes(ckpt: Checkpoint, lay: BlockLayout, target_dtype: dict[str, str], name: str) -> torch.Tensor:
    """The tensor's bytes in the dtype the slot holds it in (the layout's: what the model computes in,
    or an FP8 weight's and its scale's as stored): a page-cache view when no cast is needed."""
    info = ckpt.tensors[name]
    target = next(t.dtype for t in lay.tensors if t.name == name)
    if info.dtype == target:
        return ckpt.file_bytes(info.path)[info.start : info.end]
    return ckpt.view(name).to(torch_dtype(target)).contiguous().view(torch.uint8).flatten()
