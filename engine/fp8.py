"""FP8 weight streaming (`--stream-dtype fp8`): which tensors stream as float8 e4m3, how a streamed
block's slot holds them, and what that changes in a model's facts. Torch-free.

Owns: the rule (`quantizable`: a block's 2-D `.weight` of at least `MIN_ELEMENTS` elements, i.e. its
linear layers' weights; norms, biases, modulation tables and small tensors stay in the compute dtype;
embeddings are not in blocks), the stored format (`NAME` as F8_E4M3 and `NAME_scale` beside it: one
float32 per output row, `w ~= q * scale[:, None]`, `scale = max|w[row]| / 448`), `Fp8Plan` (per
model: which weights stream as FP8 and whether the folder stores them, `dlo quantize`, or they are
converted at load), `fp8_plan` (the plan of a checkpoint for a stream dtype), `wire_layout` (a
block's slot layout: FP8 weights with their scales, the other tensors as they compute) with
`DequantPiece`s (where each weight is dequantized to), and `stream_facts` (the `ModelFacts` of the
stream: what the memory model and the policy plan with).
Must never: import torch (`dlo.engine.quantize` holds the arithmetic), or quantize a tensor the rule
leaves out.

On the device the block's bytes land in its slot (H2D and AllGather carry the FP8 bytes: half of a
linear weight's), then one dequantization per block writes each FP8 weight into a bfloat16 buffer the
block's linear layers read (`dlo.engine.transfers.Dequantize`); compute stays in the compute dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

from dlo.engine.checkpoint import DTYPE_SIZES, Checkpoint
from dlo.engine.layout import ALIGN, BlockLayout, align_up, build_layout
from dlo.engine.settings import ConfigError

FP8 = "F8_E4M3"
SCALE_DTYPE = "F32"
SCALE_SUFFIX = "_scale"
E4M3_MAX = 448.0
MIN_ELEMENTS = 1024  # below it a tensor stays in the compute dtype (the saving is nothing, the scale not)
CONVERTIBLE = frozenset({"BF16", "F16", "F32"})


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a block tensor streams as FP8: a linear layer's 2-D weight, not a small one."""
    return len(shape) == 2 and name.endswith(".weight") and math.prod(shape) >= MIN_ELEMENTS


def scale_name(weight: str) -> str:
    return weight + SCALE_SUFFIX


@dataclass(frozen=True)
class Fp8Plan:
    """One model's FP8 stream: weight name -> its scale's name, and where their bytes come from."""

    quantized: Mapping[str, str]
    stored: bool  # the folder stores them (`dlo quantize`); False: converted at load (the arena holds them)

    @property
    def scales(self) -> frozenset[str]:
        return frozenset(self.quantized.values())


def stored_weights(ckpt: Checkpoint) -> dict[str, str]:
    """The weights a folder stores as FP8 with their scale beside them (`dlo quantize`'s format)."""
    return {n: scale_name(n) for n, info in ckpt.tensors.items()
            if info.dtype == FP8 and scale_name(n) in ckpt.tensors}


def fp8_plan(ckpt: Checkpoint, block_names: Iterable[str], stream_dtype: str) -> Fp8Plan | None:
    """The FP8 stream of a checkpoint's blocks for `stream_dtype` (None: it streams as stored).
    A folder of FP8 weights streams them (its bfloat16 bytes are gone: `ConfigError` unless fp8); a
    bfloat16 folder with fp8 converts the rule's weights at load."""
    stored = stored_weights(ckpt)
    if stored:
        if stream_dtype != "fp8":
            raise ConfigError(f"{ckpt.root}: the folder holds FP8 weights (dlo quantize); serve it with "
                              f"--stream-dtype fp8, or the bfloat16 folder it was made from")
        return Fp8Plan(stored, stored=True)
    if stream_dtype != "fp8":
        return None
    chosen = {n: scale_name(n) for n in block_names
              if quantizable(n, ckpt.tensors[n].shape) and ckpt.tensors[n].dtype in CONVERTIBLE}
    return Fp8Plan(chosen, stored=False) if chosen else None


@dataclass(frozen=True)
class DequantPiece:
    """One FP8 weight of a block: where its bytes and its scale sit in the slot, and where its
    dequantized values go in the dequant buffer (in `dtype`, the dtype it computes in)."""

    name: str
    shape: tuple[int, int]
    src: int  # offset of the FP8 bytes in the slot
    scale: int  # offset of the float32 scales in the slot
    dst: int  # offset in the dequant buffer
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def wire_layout(ckpt: Checkpoint, keys: Iterable[str], dtype_of: Mapping[str, str],
                plan: Fp8Plan) -> tuple[BlockLayout, tuple[DequantPiece, ...]]:
    """A block's slot layout with its FP8 weights and their scales (in file order where the folder
    stores them, so that copies stay few runs; a converted weight's scale right after it), and the
    dequantization of each weight into a buffer of the block's bfloat16 weights."""
    entries: list[tuple[tuple, str, str, tuple[int, ...]]] = []
    for name in keys:
        info = ckpt.tensors[name]
        where = (str(info.path), info.start)
        if name not in plan.quantized:
            entries.append((where, name, dtype_of.get(name, info.dtype), info.shape))
            continue
        entries.append((where, name, FP8, info.shape))
        stored = ckpt.tensors.get(plan.quantized[name]) if plan.stored else None
        at = (str(stored.path), stored.start) if stored is not None else (where[0], where[1], 1)
        entries.append((at, plan.quantized[name], SCALE_DTYPE, (info.shape[0],)))
    entries.sort(key=lambda e: e[0])
    layout = build_layout([(name, dtype, shape) for _, name, dtype, shape in entries])
    offsets = {t.name: t.offset for t in layout.tensors}
    pieces, dst = [], 0
    for t in layout.tensors:
        if t.name in plan.quantized:
            rows, cols = t.shape
            pieces.append(DequantPiece(t.name, (rows, cols), t.offset, offsets[plan.quantized[t.name]], dst,
                                       dtype_of.get(t.name, "BF16")))
            dst = align_up(dst + pieces[-1].nbytes)
    return layout, tuple(pieces)


def dequant_bytes(pieces: Iterable[DequantPiece]) -> int:
    """The dequant buffer one block needs (its pieces' end, 256-byte aligned)."""
    return max((align_up(p.dst + p.nbytes, ALIGN) for p in pieces), default=0)


def compute_bytes(ckpt: Checkpoint, names: Iterable[str], plan: Fp8Plan | None, compute: str = "BF16") -> int:
    """What `names` take in their compute dtype (an FP8 weight as `compute`, its scale not at all)."""
    total = 0
    for name in names:
        if plan is not None and name in plan.scales:
            continue
        info = ckpt.tensors[name]
        size = DTYPE_SIZES[compute] if plan is not None and plan.stored and name in plan.quantized else DTYPE_SIZES[info.dtype]
        total += math.prod(info.shape) * size
    return total
