"""A LoRA merge in one pass on cuda: W + factor * (B A), rounded as peft's two steps, in one Triton kernel.

Owns: `merge_kernel` (the Triton kernel, compiled on first launch; None where Triton is not
importable), `KernelShape` (its tiles, warps and grid), `FusedMerge` (which merges it may run, its
launch, and its check against the two torch steps: every kind an adapter merges as, at load,
`prepare`; any other on its first merge) and `same_bits`.
Must never: give other bytes than the two torch steps of `dlo.engine.lora.merge_steps` (the first
merge of each (shape, dtype, rank, factor or none) is made both ways and compared; a kind that
differs is merged by the torch steps from then on, with a warning), fail a request (a kernel that
does not compile or launch leaves every merge to the torch steps), or write into the weight it reads.

[Note: the fused merge] peft's two steps over a whole weight move ~8 bytes of HBM an element in
bfloat16: B A written by the GEMM, read back beside W, the sum written. Row steps small enough for
the L2 (`bench/lora_merge_steps.py` at f2f7834, 2026-12-06, one H100) did not help: a dirty line of B A is written
back to HBM all the same, only its read is saved, and the steps' launches (~90 a Wan2.1 block) cost
more than that (1.10 ms a block in 8 MiB steps against 1.03 in one, device time alone). This kernel
computes each tile of B A in registers (K = the rank, accumulated in float32 by the tensor cores and
rounded once, as the GEMM's epilogue rounds), multiplies and rounds it as `mul_` does, adds W's tile
and rounds once more as `add_` does: W read and the sum written, ~4 bytes an element, one launch a
layer. Whether the float32 sums equal cuBLAS's is the hardware's order of accumulation, not a
promise: hence the check (`bench/lora_merge_kernel.py` compares every adapted shape of Wan2.1 and
Flux.1-dev on the device).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from dlo.engine.lora.merge_steps import two_steps
from dlo.engine.platform import triton_modules

log = logging.getLogger(__name__)

RANKS = (16, 32, 64, 128)  # adapter ranks the kernel takes (tl.dot: a power of two, at least 16)
DTYPES = (torch.bfloat16, torch.float16)  # a float32 dot would round its inputs to TF32
Launch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "float | None"], None]


@dataclass(frozen=True)
class KernelShape:
    """How the kernel splits a weight: a program's tile (`rows` x `cols` of the merged weight), its
    warps, and how many programs (None: one a tile; N: N programs, each looping over every Nth tile,
    a persistent grid that leaves the other SMs to whatever runs beside it). Any shape gives the same
    bytes: a tile's element is its own row of B times A, in the same K order."""

    rows: int = 128
    cols: int = 128
    warps: int = 8
    programs: int | None = None

    def grid(self, m: int, n: int) -> tuple[int, int]:
        """(programs, tiles each program merges at most) for an m x n weight."""
        tiles = -(-m // self.rows) * -(-n // self.cols)
        programs = tiles if self.programs is None else max(1, min(self.programs, tiles))
        return programs, -(-tiles // programs)


# measured (records `raw-lora-merge-sweep-2026-12-06`, `-b`): the fastest of the sweep on an H100 and an
# H200, a Wan2.1 block's merges 0.539 and 0.426 ms against 0.575 and 0.469 for 64x128 with 4 warps
# (`raw-lora-merge-kernel-2026-12-06`'s), the same bytes
DEFAULT_SHAPE = KernelShape()


@functools.cache
def merge_kernel() -> Any:
    """The Triton kernel (one per process; None where Triton is not importable)."""
    modules = triton_modules()
    if modules is None:
        return None
    triton, tl = modules

    @triton.jit
    def merge_lora(out_ptr, w_ptr, b_ptr, a_ptr, M, N, factor, programs, R: tl.constexpr, HAS_FACTOR: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, ITERS: tl.constexpr):
        tiles_m = tl.cdiv(M, BM)
        tiles = tiles_m * tl.cdiv(N, BN)
        ks = tl.arange(0, R)
        for i in range(ITERS):  # tiles pid, pid + programs, ...: row tiles vary fastest
            tile = tl.program_id(0) + i * programs
            rows = (tile % tiles_m) * BM + tl.arange(0, BM)
            cols = (tile // tiles_m) * BN + tl.arange(0, BN)
            row_ok, col_ok = (rows < M) & (tile < tiles), cols < N
            b = tl.load(b_ptr + rows[:, None].to(tl.int64) * R + ks[None, :], mask=row_ok[:, None], other=0.0)
            a = tl.load(a_ptr + ks[:, None].to(tl.int64) * N + cols[None, :], mask=col_ok[None, :], other=0.0)
            delta = tl.dot(b, a, out_dtype=tl.float32).to(out_ptr.dtype.element_ty)  # round(B A), as torch.mm
            if HAS_FACTOR:
                delta = (delta.to(tl.float32) * factor).to(out_ptr.dtype.element_ty)  # as mul_ by a float
            offs = rows[:, None].to(tl.int64) * N + cols[None, :]
            ok = row_ok[:, None] & col_ok[None, :]
            w = tl.load(w_ptr + offs, mask=ok)
            tl.store(out_ptr + offs, (delta.to(tl.float32) + w.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)

    return merge_lora


def launch_triton(out: torch.Tensor, weight: torch.Tensor, B: torch.Tensor, A: torch.Tensor,
                  factor: float | None, shape: KernelShape = DEFAULT_SHAPE) -> None:
    """`out` = `weight` + `factor` * (B A) by the Triton kernel (contiguous, one dtype, on cuda)."""
    m, n = out.shape
    programs, iters = shape.grid(m, n)
    merge_kernel()[(programs,)](out, weight, B, A, m, n, 1.0 if factor is None else float(factor), programs,
                                R=A.shape[0], HAS_FACTOR=factor is not None, BM=shape.rows, BN=shape.cols, ITERS=iters,
                                num_warps=shape.warps)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors hold the same bytes (`torch.equal` holds -0 == 0 and NaN != NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


class FusedMerge:
    """The merges one rank runs in one pass ([Note: the fused merge]), each kind checked on first use."""

    def __init__(self, launch: Launch = launch_triton, device_type: str = "cuda",
                 dtypes: tuple[torch.dtype, ...] = DTYPES, ranks: tuple[int, ...] | None = RANKS):
        """`launch`: the kernel's launch, on `device_type`, for `dtypes` and `ranks` (None: any; tests
        pass stand-ins that run on cpu)."""
        self.launch = launch
        self.device_type, self.dtypes, self.ranks = device_type, dtypes, ranks
        self.verdicts: dict[tuple, bool] = {}  # kind -> whether the kernel gave the two steps' bytes
        self.launches = 0  # merges made by the kernel (the tests and the bench read it)
        self.failed: str | None = None  # why the kernel could not run here (then: two steps for every kind)

    @classmethod
    def on(cls, device: torch.device) -> "FusedMerge | None":
        """The fused merge for `device`, None where it cannot run (not cuda, or no Triton)."""
        if torch.device(device).type != "cuda" or merge_kernel() is None:
            return None
        return cls()

    def kind(self, out: torch.Tensor, weight: torch.Tensor, B: torch.Tensor, A: torch.Tensor, factor: Any) -> tuple | None:
        """What a merge's check is keyed on; None where the kernel does not take it."""
        tensors = (out, weight, B, A)
        if (out.dim() != 2 or out.shape != weight.shape or out.shape != (B.shape[0], A.shape[-1])
                or B.dim() != 2 or A.dim() != 2 or B.shape[1] != A.shape[0]
                or out.device.type != self.device_type or out.dtype not in self.dtypes
                or (self.ranks is not None and A.shape[0] not in self.ranks)
                or any(t.dtype != out.dtype or not t.is_contiguous() for t in tensors)
                or not (factor is None or isinstance(factor, float))):
            return None
        return tuple(out.shape), out.dtype, A.shape[0], factor is not None

    def merge(self, out: torch.Tensor, weight: torch.Tensor, B: torch.Tensor, A: torch.Tensor, factor: Any) -> bool:
        """`out` = `weight` + `factor` * (B A) in one pass; False (nothing written) where this kind is
        not the kernel's or gave other bytes than the two steps when checked."""
        kind = self.kind(out, weight, B, A, factor)
        if kind is None or self.failed is not None or self.verdicts.get(kind) is False:
            return False
        try:
            self.launch(out, weight, B, A, factor)
        except Exception as e:  # it did not compile or launch on this machine: never a failed request
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("lora fused merge cannot run here (%s): every merge in two steps", self.failed)
            return False
        self.launches += 1
        if kind not in self.verdicts:
            verdict = self._check(kind, out, weight, B, A, factor)
            if verdict is not None:
                self.verdicts[kind] = verdict
        return True

    def prepare(self, branches: Iterable[Any], device: torch.device) -> None:
        """Compile and check, before any request, every kind `branches` (`Branch`es: B, A) merge as,
        with and without a factor, on random weights of their shapes: a request then never waits for
        a compile or a check."""
        gen = torch.Generator(device=device).manual_seed(29)

        def rand(rows: int, cols: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=gen, device=device) * scale).to(dtype)

        for rows, cols, dtype, rank in sorted({(b.B.shape[0], b.A.shape[1], b.B.dtype, b.A.shape[0])
                                               for b in branches}, key=str):
            weight, B, A = rand(rows, cols, dtype, 1.0), rand(rows, rank, dtype, 0.05), rand(rank, cols, dtype, 0.05)
            for factor in (None, 0.8):
                self.merge(torch.empty_like(weight), weight, B, A, factor)

    def _check(self, kind: tuple, out: torch.Tensor, weight: torch.Tensor, B: torch.Tensor, A: torch.Tensor,
               factor: Any) -> bool | None:
        """Whether the kernel's `out` is the two steps' bytes, bit for bit; where not, `out` gets those.
        None (no verdict yet: a later merge checks) where the device has no room to compare."""
        try:
            want = torch.empty_like(out)
        except torch.OutOfMemoryError:
            two_steps(out, weight, B, A, factor)  # the bytes the check would keep, unchecked
            return None
        two_steps(want, weight, B, A, factor)
        same = same_bits(out, want)
        if same:
            log.info("lora fused merge gives the two-step merge's bytes for %s: that kind merges in one pass", kind)
        else:
            out.copy_(want)
            log.warning("lora fused merge differs from the two-step merge for %s: that kind merges in two steps", kind)
        return same
