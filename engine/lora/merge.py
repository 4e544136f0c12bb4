"""A request's adapter merged into the weight a layer computes with, per call, in a scratch of the rank's own.

Owns: `merge_weight` (W + scaling * B A in peft's merge order, written into a given tensor),
`merge_bias`, `MergeScratch` (one device buffer per dtype, the size of the largest targeted
weight, and its views as parameters, made once per shape) and `MergeCache` (merged weights of
resident layers kept per adapter and scale, up to a byte budget, the least recently used dropped
first). `LoraBank` swaps a cached merge, else a scratch view, in as the layer's weight before the
layer runs and its own weight back after (`dlo serve --lora-apply merge|auto [--lora-merge-cache BYTES|auto]`).
Must never: write into a layer's weight or bias (a resident weight is every later request's base; a
streamed one is the slot the next copy fills and, in allgather mode, the wave's shared gather), or
import peft.

[Note: LoRA merge order] peft 0.21's `lora.Linear.merge`, what diffusers' `fuse_lora` runs:
delta = (B @ A) * scaling, in float32 on cpu for a bfloat16 or float16 adapter and cast back
(`get_delta_weight`'s cast_to_fp32), else in the adapter's dtype; W' = round(W + delta); a lora bias
adds round(b * scaling) to the layer's bias. `merge_weight` runs exactly these steps (delta written
into the scratch, W added into it: the same sum, W + delta = delta + W), so a request equals
diffusers + load_lora_weights + fuse_lora(lora_scale=scale) bit for bit where the kernels are the
same. A scaling folded into B (a power of two, `weights._fold`) gives the same delta: B' A is
(B A) * 2^k exactly. W + B A as one `addmm` into the scratch (`in_gemm`: half the passes over W)
rounds once where peft rounds twice: on CPU they differ (bf16: 350,703 of 4.19M elements at LoRA-like
sizes); on the H200 the LoRA bench's `merge_in_gemm` variant gave the same bytes for Wan2.1 and Flux
and no gain (13.650 against 13.639 ms a Wan2.1 block at 7,800 tokens, 2026-12-02), so the engine
always gives the bytes of peft's two steps and only the bench runs the one GEMM.

Cost, against the branch: a pass that reads W and writes the scratch (plus the K = r product), where
the branch reads the layer's input once more and its output twice, so the merge is cheaper where a
call's tokens outnumber the layer's width (Wan2.1 832x480x17: 7,800 tokens a call, cond and uncond
being two calls, against 5,120).
Memory: the largest targeted weight once per rank (Wan2.1-14B's FFN: 141.6 MB in bfloat16).

[Note: merging in one pass] On cuda, `merge_weight` runs the two steps as one Triton kernel where
it takes the merge and has given the two steps' bytes (`dlo.engine.lora.merge_kernel`, [Note: the
fused merge]): W read and the sum written, ~4 bytes of HBM an element where the two steps move ~8
(Wan2.1-14B: 1.40 GB a block instead of 2.81). It is the default, `--lora-merge-kernel triton`
(measured: bit-identical on every Wan2.1 and Flux.1-dev shape, 0.56 ms a Wan2.1 block against 1.03 on an
H100; `torch` keeps the two steps).

[Note: the merge cache] A resident layer's weight never changes, so its merge for one adapter and
scale is the same tensor every call: with a `--lora-merge-cache` (BYTES, or the default auto: the
device budget's spare, sized by `dlo.plan.deployment.auto_merge_cache`) the first call's merge is kept
(its own device tensor, the same bytes the scratch would hold) and later calls swap it in with no
work, so a request with a cached adapter costs what the base model costs. A streamed layer's weight
is the slot of this call only: it always merges into the scratch. The cache fills in the order the
layers run; an (adapter, scale) that does not fit whole keeps what fits, after the least recently
used others are dropped (never the request's own). The budget counts the whole cache as taken.
On cuda the kept merges come from a memory pool of their own: made during a request, from the
allocator's shared pool they were cut out of the large blocks its activations had freed, and a
later large allocation found no block whole (an 80 GB card, Wan2.1 resident with 28 GB of merges:
the VAE decode's 884 MiB refused with 7.5 GiB free in pieces, 2026-12-06; with the pool the same
run served at 0.993x, record `lora-h100-2026-12-06-kernel`).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from dlo.engine.lora.adapters import merge_scratch_elements
from dlo.engine.lora.merge_kernel import FusedMerge
from dlo.engine.lora.merge_steps import two_steps
from dlo.engine.lora.weights import Branch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MergeWay:
    """How `merge_weight` runs: in one pass where `fused` takes the merge ([Note: merging in one
    pass]), else peft's two steps, or as one addmm (`in_gemm`: the bench's variant, see the note)."""

    fused: FusedMerge | None = None
    in_gemm: bool = False


TWO_STEPS = MergeWay()


def merge_weight(out: torch.Tensor, weight: torch.Tensor, b: Branch, factor: Any,
                 way: MergeWay = TWO_STEPS) -> torch.Tensor:
    """`out` = `weight` + `factor` (None: 1) * B A, rounded as peft merges ([Note: LoRA merge order])."""
    assert out.data_ptr() != weight.data_ptr(), "a merge never writes into the weight it reads"
    if way.in_gemm and factor is None:
        return torch.addmm(weight, b.B, b.A, out=out)
    if way.fused is None or not way.fused.merge(out, weight, b.B, b.A, factor):
        two_steps(out, weight, b.B, b.A, factor)
    return out


def merge_layer(into: tuple, weight: torch.Tensor, bias: torch.Tensor | None, b: Branch, factor: Any,
                way: MergeWay = TWO_STEPS) -> "Merged":
    """A layer's (weight, bias) merged with `b` into `into` (its weight and, with a lora bias, its
    bias tensor: a scratch's views or a cache's new tensors); the bias None where `b` has none."""
    merged_bias = None if b.bias is None else merge_bias(into[1], bias, b, factor)
    return merge_weight(into[0], weight, b, factor, way), merged_bias


def merge_bias(out: torch.Tensor, bias: torch.Tensor | None, b: Branch, factor: Any) -> torch.Tensor:
    """`out` = `bias` + round(lora bias * factor): peft's bias merge (a layer without a bias of its own,
    which peft refuses to merge, gets the lora bias alone: the branch's sum)."""
    assert b.bias is not None
    out.copy_(b.bias if factor is None else b.bias * factor)
    return out if bias is None else out.add_(bias)


class MergeScratch:
    """Device buffers the merged weights (and biases) are written into, one per dtype, reused by
    every layer in turn: a layer's merged weight is read by its own forward before the next layer's
    merge is queued behind it on the same stream."""

    def __init__(self, branches: Iterable[Branch], device: torch.device):
        weights, biases = merge_scratch_elements((b.B.dtype, b.B.shape[0], b.A.shape[1], b.bias is not None)
                                                 for b in branches)
        self._weights = {d: torch.empty(n, dtype=d, device=device) for d, n in weights.items()}
        self._biases = {d: torch.empty(n, dtype=d, device=device) for d, n in biases.items()}
        self._views: dict[tuple, nn.Parameter] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._weights.values(), *self._biases.values()))

    def holds(self, t: torch.Tensor) -> bool:
        """Whether `t` is one of this scratch's views (they all start at their buffer's start)."""
        return any(t.data_ptr() == buf.data_ptr() for buf in (*self._weights.values(), *self._biases.values()))

    def views_for(self, b: Branch, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        """The scratch as (weight, lora bias or None) of `b`'s layer, to merge into (`merge_layer`)."""
        return self.weight_for(b, weight), None if b.bias is None else self.bias_for(b, bias)

    def weight_for(self, b: Branch, like: torch.Tensor) -> nn.Parameter:
        """The scratch as the (out, in) weight of `b`'s layer, flagged as the layer's own weight `like`
        is (`requires_grad` steers ATen's kernel choice: see `weights._trainable`)."""
        return self._view(self._weights, (b.B.shape[0], b.A.shape[1]), b.B.dtype, like.requires_grad)

    def bias_for(self, b: Branch, like: torch.Tensor | None) -> nn.Parameter:
        return self._view(self._biases, (b.B.shape[0],), b.B.dtype, like is not None and like.requires_grad)

    def _view(self, buffers: dict, shape: tuple[int, ...], dtype: torch.dtype, grad: bool) -> nn.Parameter:
        key = (buffers is self._weights, shape, dtype, grad)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = nn.Parameter(buffers[dtype][:math.prod(shape)].view(shape), requires_grad=grad)
        return view

    def close(self) -> None:
        self._views.clear()
        self._weights.clear()
        self._biases.clear()


Merged = tuple[nn.Parameter, "nn.Parameter | None"]  # a layer's merged weight and bias (None: its own bias)


class MergeCache:
    """Merged weights of resident layers on the device, per (adapter, scale), up to `capacity` bytes
    ([Note: the merge cache])."""

    def __init__(self, capacity: int, device: torch.device | str = "cpu"):
        self.capacity, self.used = capacity, 0
        # the kept merges' own memory on cuda ([Note: the merge cache])
        self._pool = _own_pool() if torch.device(device).type == "cuda" else None
        self._entries: OrderedDict[tuple[str, float], dict[nn.Module, Merged]] = OrderedDict()
        self._bytes: dict[tuple[str, float], int] = {}

    def new_parameter(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                      grad: bool) -> nn.Parameter | None:
        """A tensor to keep a merge in, from the cache's own pool where it has one; None where the
        device has no room for it (the layer then merges into the scratch, uncached)."""
        if self._pool is None:
            return new_parameter(shape, dtype, device, grad)
        try:
            return self._in_pool(shape, dtype, device, grad)
        except torch.OutOfMemoryError:
            # the shared pool's cached blocks: an allocation into a pool of its own does not take them
            # back before it fails (pytorch/pytorch#159674)
            torch.cuda.empty_cache()
        try:
            return self._in_pool(shape, dtype, device, grad)
        except torch.OutOfMemoryError:
            return None

    def _in_pool(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, grad: bool) -> nn.Parameter:
        with torch.cuda.use_mem_pool(self._pool, device):
            return new_parameter(shape, dtype, device, grad)

    def entries(self, key: tuple[str, float]) -> dict[nn.Module, Merged]:
        """The layers merged for `key` so far (the most recently used key from now on)."""
        if key not in self._entries:
            self._entries[key], self._bytes[key] = {}, 0
        self._entries.move_to_end(key)
        return self._entries[key]

    def keep(self, key: tuple[str, float], layer: nn.Module, merged: Merged) -> None:
        nbytes = sum(t.numel() * t.element_size() for t in merged if t is not None)
        self._entries[key][layer] = merged
        self._bytes[key] += nbytes
        self.used += nbytes

    def room_for(self, key: tuple[str, float], nbytes: int) -> bool:
        """Whether `nbytes` more fit for `key`, after dropping the least recently used other keys
        (none is dropped for what would not fit even alone)."""
        if nbytes > self.capacity - self._bytes.get(key, 0):
            return False
        for other in [k for k in self._entries if k != key]:
            if self.used + nbytes <= self.capacity:
                break
            self.used -= self._bytes.pop(other)
            del self._entries[other]
        return self.used + nbytes <= self.capacity

    @property
    def keys(self) -> tuple[tuple[str, float], ...]:
        return tuple(self._entries)

    def close(self) -> None:
        self._entries.clear()
        self._bytes.clear()
        self.used = 0
        self._pool = None


def _own_pool() -> Any:
    """A cuda memory pool of its own, None where this torch has none (the shared pool then)."""
    try:
        return torch.cuda.MemPool()
    except (AttributeError, RuntimeError) as e:
        log.warning("lora merge cache without a memory pool of its own (%s): its merges share the allocator's", e)
        return None


def new_parameter(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, grad: bool) -> nn.Parameter:
    """A device tensor to keep a merge in, made outside inference mode (a request's forward runs
    inside it; what is made there cannot be kept as a parameter for later)."""
    with torch.inference_mode(False):
        return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=grad)
