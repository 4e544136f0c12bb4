"""The adapters of one rank, on its device, and the branch a request runs with.

Owns: `LoraBank` (every adapter of `--lora-dir`, loaded once at start onto this rank's device, and
`applied(name, scale)`: the forward hooks of one request, removed when it ends), and `add_branch`,
the op order every targeted layer's output gets (peft 0.21's `lora.Linear.forward`, unmerged).
With `--lora-apply merge` the hooks instead swap in, for each targeted layer's call, its weight
merged with the adapter in a scratch of the rank's own (`dlo.engine.lora.merge`, peft's merge order).
Must never: write into a layer's weight (in allgather mode that is the shared slot every rank of
the wave computes from), keep a hook or a swapped weight past the request that installed it, or
import peft.

[Note: LoRA op order] peft computes `result + lora_B(lora_A(x)) * scaling` with the input cast to
the adapter's dtype: h = round(x A^T), t = round(h B^T + b), u = round(t * scaling), y = round(out + u).
`add_branch` does exactly these roundings (in place: the same values, one tensor less), so a request
equals diffusers + peft bit for bit where the kernels are the same (measured on CPU in f32 and bf16).
`t * 1.0` is exact, so the multiply is skipped when the scaling is 1 (alpha = r, or a power of two
folded into B at load, `weights._fold`); a scale of 0 runs no branch at all (the base model exactly).

[Note: the add in B's product] On cuda the branch's last two steps, round(h B^T) and round(out + t),
run as one `addmm_` into the layer's output (no bias, no multiply, same dtype): measured bit-identical
to the two-step order on the H200 at every token count of the LoRA bench (`lora_separate_add`, its
control, gave the same bytes for a whole Wan2.1 forward) and cheaper (it reads and writes the output
once instead of writing t and reading both back: 1.058x against 1.077x per block at 7,800 tokens).
On cpu the two differ (the GEMM adds into its accumulator before rounding), so cpu keeps two steps.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from dlo.engine.hooks import HookSet
from dlo.engine.lora.adapters import AdapterError, find_adapters
from dlo.engine.lora.merge import MergeScratch, merge_bias, merge_weight
from dlo.engine.lora.weights import Branch, branches, read_adapter

log = logging.getLogger(__name__)


# device types whose GEMM adds into its output bit-identically to a separate add ([Note: the add in B's product])
ADD_IN_GEMM = frozenset({"cuda"})


def add_branch(out: torch.Tensor, x: torch.Tensor, b: Branch, factor: Any, add_in_gemm: bool = False) -> torch.Tensor:
    """`out` plus the branch of input `x` times `factor` (None: 1), in peft's order ([Note: LoRA op order]);
    with `add_in_gemm`, B's product adds into `out` in the GEMM where that changes no bit."""
    if x.dtype != b.A.dtype:
        x = x.to(b.A.dtype)
    h = F.linear(x, b.A)
    if add_in_gemm and factor is None and b.bias is None and out.dtype == h.dtype and out.is_contiguous():
        out.view(-1, out.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), b.B.t())
        return out
    t = F.linear(h, b.B, b.bias)
    if factor is not None:
        t.mul_(factor)
    if t.dtype == out.dtype:
        return out.add_(t)
    return (out + t).to(out.dtype)


class LoraBank:
    """Every adapter of one rank by name (`{layer: Branch}` each) on the rank's device."""

    def __init__(self, adapters: dict[str, dict[nn.Module, Branch]], add_in_gemm: bool = False,
                 scratch: MergeScratch | None = None):
        self.adapters = adapters
        self.add_in_gemm = add_in_gemm  # [Note: the add in B's product]
        self.scratch = scratch  # `--lora-apply merge`: where each layer's merged weight is written
        self._active: dict[nn.Module, tuple[Branch, Any]] = {}
        self._swapped: dict[nn.Module, tuple[Any, Any]] = {}  # layer -> its own (weight, bias) while merged
        self._hooks = HookSet()

    @classmethod
    def load(cls, lora_dir: Path | str | None, pipeline_class: str, transformer_dir: Path, model: Any,
             device: torch.device, apply: str = "branch") -> "LoraBank":
        """Read, check and place every adapter of `lora_dir` (None: none) for the transformer `model`
        (an `OffloadedModel`, any mode) loaded from `transformer_dir`, applied as `apply` says
        (`LoraSettings.apply`: "branch" or "merge")."""
        if lora_dir is None:
            return cls({})
        from dlo.engine.checkpoint import cached_checkpoint

        weights = cached_checkpoint(transformer_dir).tensors
        adapters = {}
        for entry in find_adapters(lora_dir):
            adapters[entry.name] = branches(read_adapter(entry, pipeline_class, weights), model.module, device,
                                            model.dtype_of)
        scratch = None
        if apply == "merge" and adapters:
            scratch = MergeScratch((b for br in adapters.values() for b in br.values()), torch.device(device))
        bank = cls(adapters, add_in_gemm=torch.device(device).type in ADD_IN_GEMM, scratch=scratch)
        log.info("lora adapters loaded count=%d device=%s apply=%s device_bytes=%d (merge scratch %d) per_adapter=%s",
                 len(adapters), device, apply, bank.device_bytes, scratch.nbytes if scratch else 0,
                 {n: sum(b.nbytes for b in br.values()) for n, br in adapters.items()})
        return bank

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.adapters)

    @property
    def device_bytes(self) -> int:
        """Device bytes of every adapter's tensors and the merge scratch (on cpu: host memory of this rank)."""
        return (sum(b.nbytes for br in self.adapters.values() for b in br.values())
                + (self.scratch.nbytes if self.scratch is not None else 0))

    @contextmanager
    def applied(self, name: str | None, scale: float = 1.0) -> Iterator[None]:
        """The forwards inside run adapter `name` at `scale` (peft's `scaling * scale`); nothing for
        no adapter or scale 0. The hooks are removed on the way out, whatever happens inside."""
        if name is None or scale == 0:
            yield
            return
        if name not in self.adapters:  # the API refuses unknown names: a caller's bug
            raise AdapterError(name, f"no adapter {name!r} on this rank; loaded: {', '.join(self.adapters) or 'none'}")
        for layer, b in self.adapters[name].items():
            factor = b.scaling if scale == 1.0 else b.scaling * scale
            self._active[layer] = (b, None if isinstance(factor, float) and factor == 1.0 else factor)
            if self.scratch is None:
                self._hooks.add_post(layer, self._hook)
            else:
                self._hooks.add_pre(layer, self._merge_in)
                self._hooks.add_post(layer, self._merge_out)
        try:
            yield
        finally:
            self._hooks.remove()
            for layer in list(self._swapped):  # a forward that raised skipped its layer's post-hook
                self._restore(layer)
            self._active.clear()

    def _hook(self, layer: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        b, factor = self._active[layer]
        return add_branch(out, args[0], b, factor, self.add_in_gemm)

    def _merge_in(self, layer: nn.Module, _args: tuple) -> None:
        """The layer runs with its weight (as bound now: resident, or this block's slot view) merged."""
        assert self.scratch is not None
        b, factor = self._active[layer]
        weight, bias = layer._parameters["weight"], layer._parameters.get("bias")
        merged = merge_weight(self.scratch.weight_for(b, weight), weight, b, factor, self.add_in_gemm)
        self._swapped[layer] = (weight, bias)
        layer._parameters["weight"] = merged
        if b.bias is not None:
            layer._parameters["bias"] = merge_bias(self.scratch.bias_for(b, bias), bias, b, factor)

    def _merge_out(self, layer: nn.Module, _args: tuple, _out: Any) -> None:
        self._restore(layer)

    def _restore(self, layer: nn.Module) -> None:
        weight, bias = self._swapped.pop(layer)
        layer._parameters["weight"] = weight
        if "bias" in layer._parameters or bias is not None:
            layer._parameters["bias"] = bias

    def close(self) -> None:
        self._hooks.remove()
        for layer in list(self._swapped):
            self._restore(layer)
        self._active.clear()
        self.adapters = {}
        if self.scratch is not None:
            self.scratch.close()
            self.scratch = None
