"""A streamed block's FP8 weights dequantized in one launch (FP8 streaming on cuda): a Triton kernel
that reads a table of the block's weights, one row of the table a weight.

Why one launch a block: a weight at a time, the compiled kernel of
`dlo.engine.quantize` costs the host ~1.1 ms to launch a Flux.1-dev double block's 16 weights
(torch.compile's guards and wrapper, ~65 us a call) and the in-place form the engine calls 0.76 ms
of the device; this kernel 0.13 ms of the host and 0.35 ms of the device, the same bytes
(record `fp8-dequant-h200-2026-12-02-c`).

Owns: `block_kernel` (the Triton kernel, compiled on first launch; None where Triton is not
importable), `block_table` (a block's `DequantPiece`s as the kernel's table, None where a piece's
offsets do not fit it) and `BlockKernel` (the launch over one slot and the dequant buffer).
Must never: give other bytes than `dlo.engine.quantize.dequantize_into` (float32(q) * scale rounded
once to the compute dtype: `transfers.Dequantize` checks a weight of the first block it runs and
falls back to `dequantize_into` on a mismatch; record `fp8-dequant-h200-2026-12-02-c` checked whole blocks).
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import torch

from dlo.engine.checkpoint import DTYPE_SIZES
from dlo.engine.fp8 import DequantPiece
from dlo.engine.platform import triton_modules

ROWS = 8  # rows of one weight a program dequantizes
COLS = 1024  # columns a program reads at once (1 KiB of FP8 values)
TABLE_WIDTH = 5  # FP8 values' offset, scales' offset (float32 elements), output offset (elements), rows, cols
MAX_ROWS = 65_535 * ROWS  # a grid's second dimension holds 65,535 programs


@functools.cache
def block_kernel() -> Any:
    """The Triton kernel (one per process; None where Triton is not importable)."""
    modules = triton_modules()
    if modules is None:
        return None
    triton, tl = modules

    @triton.jit
    def dequantize_block(q_ptr, s_ptr, o_ptr, table_ptr, WIDTH: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK: tl.constexpr):
        w = tl.program_id(0)
        q_off = tl.load(table_ptr + w * WIDTH)
        s_off = tl.load(table_ptr + w * WIDTH + 1)
        o_off = tl.load(table_ptr + w * WIDTH + 2)
        rows = tl.load(table_ptr + w * WIDTH + 3)
        cols = tl.load(table_ptr + w * WIDTH + 4)
        r0 = tl.program_id(1).to(tl.int64) * ROWS
        if r0 < rows:  # the grid is sized for the block's tallest weight
            for r in range(ROWS):
                row = r0 + r
                if row < rows:
                    scale = tl.load(s_ptr + s_off + row)
                    for c0 in range(0, cols, BLOCK):
                        c = c0 + tl.arange(0, BLOCK)
                        m = c < cols
                        q = tl.load(q_ptr + q_off + row * cols + c, mask=m)
                        tl.store(o_ptr + o_off + row * cols + c,
                                 (q.to(tl.float32) * scale).to(o_ptr.dtype.element_ty), mask=m)

    return triton, dequantize_block


def block_table(pieces: Iterable[DequantPiece]) -> tuple[list[int], str, int] | None:
    """`pieces` as the kernel's table (flat, `TABLE_WIDTH` a weight), their compute dtype and the
    most rows of one; None for no pieces, mixed compute dtypes, a weight taller than the grid's
    second dimension holds, or a scale or output offset that is not a whole element (the layouts
    align every tensor: never seen)."""
    pieces = list(pieces)
    if not pieces or len({p.dtype for p in pieces}) != 1:
        return None
    size, tallest = DTYPE_SIZES[pieces[0].dtype], max(p.shape[0] for p in pieces)
    if tallest > MAX_ROWS or any(p.scale % 4 or p.dst % size for p in pieces):
        return None
    table = [v for p in pieces for v in (p.src, p.scale // 4, p.dst // size, p.shape[0], p.shape[1])]
    return table, pieces[0].dtype, tallest


class BlockKernel:
    """The blocks' tables on the device, each launched over slot k into the dequant buffer; a block
    whose pieces have no table (`block_table`) is not `covered`."""

    def __init__(self, pieces: list[tuple[DequantPiece, ...]], slots: list[torch.Tensor], buffer: torch.Tensor,
                 device: torch.device, kernel: Any = None):
        """`kernel`: the compiled kernel's launcher (default `block_kernel()`'s; tests pass others)."""
        self.kernel = kernel if kernel is not None else block_kernel()[1]
        tables = [block_table(p) for p in pieces]
        self.tables = [None if t is None else torch.tensor(t[0], dtype=torch.int64, device=device) for t in tables]
        self.grids = [None if t is None else (len(t[0]) // TABLE_WIDTH, -(-t[2] // ROWS)) for t in tables]
        # the slot read as FP8 values and as float32 scales, the buffer as each compute dtype
        self.slots = [(_as(s, "F8_E4M3"), _as(s, "F32")) for s in slots]
        outs = {t[1]: _as(buffer, t[1]) for t in tables if t is not None}
        self.outs = [None if t is None else outs[t[1]] for t in tables]

    def covers(self, i: int) -> bool:
        return self.tables[i] is not None

    def run(self, i: int, k: int) -> None:
        q, scales = self.slots[k]
        self.kernel[self.grids[i]](q, scales, self.outs[i], self.tables[i], WIDTH=TABLE_WIDTH, ROWS=ROWS, BLOCK=COLS)


def _as(buffer: torch.Tensor, dtype: str) -> torch.Tensor:
    """The uint8 `buffer` as `dtype` elements (its tail short of one element left out)."""
    from dlo.engine.dtypes import torch_dtype

    size = DTYPE_SIZES[dtype]
    return buffer[: buffer.numel() - buffer.numel() % size].view(torch_dtype(dtype))
