"""The adapters of one rank, on its device, and the branch a request runs with.

Owns: `LoraBank` (every adapter of `--lora-dir`, loaded once at start onto this rank's device, and
`applied(name, scale)`: the forward hooks of one request, removed when it ends), and `add_branch`,
the op order every targeted layer's output gets (peft 0.21's `lora.Linear.forward`, unmerged).
With `--lora-apply merge` (and `auto`, for a request of more than `--lora-merge-above` tokens a
transformer call) the hooks instead swap in, for each targeted layer's call, its weight merged with
the adapter in a scratch of the rank's own (`dlo.engine.lora.merge`, peft's merge order).
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
from typing import Any, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from dlo.engine.hooks import HookSet
from dlo.engine.lora.adapters import AdapterError, find_adapters, merge_bytes
from dlo.engine.lora.ahead import MergeAhead
from dlo.engine.lora.block_merges import BlockMerges
from dlo.engine.lora.merge import (
    MergeCache,
    Merged,
    MergeScratch,
    TWO_STEPS,
    MergeWay,
    merge_layer,
)
from dlo.engine.lora.merge_kernel import FusedMerge
from dlo.engine.lora.weights import Branch, branches, read_adapter
from dlo.engine.settings import LoraSettings

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


def merge_way(settings: LoraSettings, device: torch.device) -> MergeWay:
    """How this rank's merges run: in one pass where `--lora-merge-kernel triton` (the default) and the device runs the
    kernel ([Note: merging in one pass]), else in peft's two steps."""
    return MergeWay(fused=FusedMerge.on(device) if settings.merge_kernel == "triton" else None)


class LoraBank:
    """Every adapter of one rank by name (`{layer: Branch}` each) on the rank's device."""

    def __init__(self, adapters: dict[str, dict[nn.Module, Branch]], add_in_gemm: bool = False,
                 scratch: MergeScratch | None = None, cache: MergeCache | None = None,
                 streamed: Mapping[nn.Module, int] | None = None, way: MergeWay = TWO_STEPS,
                 merge_above: int = -1, ahead: MergeAhead | None = None, block_merges: BlockMerges | None = None):
        self.adapters = adapters
        self.add_in_gemm = add_in_gemm  # [Note: the add in B's product]
        self.way = way  # how a merge runs ([Note: merging in one pass]; the bench's one-GEMM merge)
        self.scratch = scratch  # `--lora-apply merge|auto`: where each layer's merged weight is written
        self.merge_above = merge_above  # with a scratch: a request merges above these tokens a call (-1: always)
        self.cache = cache  # `--lora-merge-cache`: resident layers' merges kept ([Note: the merge cache])
        self.streamed = dict(streamed or {})  # layer -> its block, where its weight is this call's slot view: never cached
        self.ahead = ahead  # the next streamed layer's merge on a side stream ([Note: merging ahead])
        self.block_merges = block_merges  # CFG pairs: a block's merges kept ([Note: a block's merges kept])
        self._cached: dict[nn.Module, Merged] | None = None  # the running request's cache entries
        self._key: tuple[str, float] = ("", 0.0)
        self._active: dict[nn.Module, tuple[Branch, Any]] = {}
        self._swapped: dict[nn.Module, tuple[Any, Any]] = {}  # layer -> its own (weight, bias) while merged
        self._hooks = HookSet()

    @classmethod
    def load(cls, settings: LoraSettings, pipeline_class: str, transformer_dir: Path, model: Any,
             device: torch.device, keep_blocks: bool = False) -> "LoraBank":
        """Read, check and place every adapter of `settings.directory` (None: none) for the transformer
        `model` (an `OffloadedModel`, any mode) loaded from `transformer_dir`, applied as
        `settings.apply` says (with up to `settings.cache_capacity` bytes of resident merges kept);
        `keep_blocks` (CFG pairs): a streamed block's merges kept for the call that runs it next, in
        place of the look-ahead ([Note: a block's merges kept])."""
        if settings.directory is None:
            return cls({})
        from dlo.engine.checkpoint import cached_checkpoint

        weights = cached_checkpoint(transformer_dir).tensors
        adapters = {}
        for entry in find_adapters(settings.directory):
            adapters[entry.name] = branches(read_adapter(entry, pipeline_class, weights), model.module, device,
                                            model.dtype_of)
        scratch, cache, ahead, kept = None, None, None, None
        streamed, way = model.streamed_modules(), merge_way(settings, device)
        if settings.apply != "branch" and adapters:
            every = [b for br in adapters.values() for b in br.values()]
            scratch = MergeScratch(every, torch.device(device))
            cache = MergeCache(settings.cache_capacity, device) if settings.cache_capacity else None
            if streamed and keep_blocks:
                kept = BlockMerges(streamed, adapters, torch.device(device))
            elif streamed:
                ahead = MergeAhead.on(every, torch.device(device))
            if way.fused is not None:  # every kind compiled and checked before a request
                way.fused.prepare(every, torch.device(device))
        bank = cls(adapters, add_in_gemm=torch.device(device).type in ADD_IN_GEMM, scratch=scratch, cache=cache,
                   streamed=streamed, way=way, merge_above=settings.merge_above, ahead=ahead, block_merges=kept)
        log.info("lora adapters loaded count=%d device=%s apply=%s device_bytes=%d (merge scratch %d, merge cache "
                 "up to %d, a block's merges kept %d) per_adapter=%s", len(adapters), device, settings.apply,
                 bank.device_bytes, scratch.nbytes if scratch else 0, cache.capacity if cache else 0,
                 kept.nbytes if kept else 0,
                 {n: sum(b.nbytes for b in br.values()) for n, br in adapters.items()})
        return bank

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.adapters)

    @property
    def device_bytes(self) -> int:
        """Device bytes of every adapter's tensors, the merge scratch and the merges cached now (on cpu:
        host memory of this rank)."""
        return (sum(b.nbytes for br in self.adapters.values() for b in br.values())
                + (self.scratch.nbytes if self.scratch is not None else 0)
                + (self.ahead.scratch.nbytes if self.ahead is not None else 0)
                + (self.block_merges.nbytes if self.block_merges is not None else 0)
                + (self.cache.used if self.cache is not None else 0))

    @contextmanager
    def applied(self, name: str | None, scale: float = 1.0, tokens: int = 0) -> Iterator[None]:
        """The forwards inside run adapter `name` at `scale` (peft's `scaling * scale`), merged where
        the bank merges and the request's transformer calls hold more than `merge_above` `tokens`
        (the whole request's, never a rank's share: the same choice on every rank), else as the
        branch; nothing for no adapter or scale 0. The hooks are removed on the way out, whatever
        happens inside."""
        if name is None or scale == 0:
            yield
            return
        if name not in self.adapters:  # the API refuses unknown names: a caller's bug
            raise AdapterError(name, f"no adapter {name!r} on this rank; loaded: {', '.join(self.adapters) or 'none'}")
        merging = self.merges(tokens)
        for layer, b in self.adapters[name].items():
            factor = b.scaling if scale == 1.0 else b.scaling * scale
            self._active[layer] = (b, None if isinstance(factor, float) and factor == 1.0 else factor)
            if not merging:
                self._hooks.add_post(layer, self._hook)
            else:
                self._hooks.add_pre(layer, self._merge_in)
                self._hooks.add_post(layer, self._merge_out)
        if self.cache is not None and merging:
            self._key = (name, float(scale))
            self._cached = self.cache.entries(self._key)
        try:
            yield
        finally:
            self._hooks.remove()
            for layer in list(self._swapped):  # a forward that raised skipped its layer's post-hook
                self._restore(layer)
            self._active.clear()
            self._cached = None
            if self.ahead is not None:
                self.ahead.end_request()
            if self.block_merges is not None:
                self.block_merges.forget()

    def merges(self, tokens: int) -> bool:
        """Whether a request of `tokens` per transformer call runs its adapter merged."""
        return self.scratch is not None and tokens > self.merge_above

    def _hook(self, layer: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        b, factor = self._active[layer]
        return add_branch(out, args[0], b, factor, self.add_in_gemm)

    def _merge_in(self, layer: nn.Module, _args: tuple) -> None:
        """The layer runs with its weight (as bound now: resident, or this block's slot view) merged:
        the cached merge of a resident layer, else one made now (into the cache where it has room)."""
        # its own weight: a layer called again before its post-hook ran (a raise caught inside the
        # forward) is still swapped, and a merge of the scratch into itself would lose W
        weight, bias = self._swapped.get(layer) or (layer._parameters["weight"], layer._parameters.get("bias"))
        merged = self._cached.get(layer) if self._cached is not None else None
        if merged is None and self.block_merges is not None:
            merged = self.block_merges.take(layer, weight, bias)
        if merged is None and self.ahead is not None:  # nothing else in flight past this
            merged = self.ahead.take(layer, weight, bias)
        if merged is None:
            merged = self._merge(layer, weight, bias)
        self._swapped[layer] = (weight, bias)
        layer._parameters["weight"] = merged[0]
        if merged[1] is not None:
            layer._parameters["bias"] = merged[1]
        if self.ahead is not None and layer in self.streamed:
            self._merge_next(layer, merged)

    def _merge_next(self, layer: nn.Module, merged: Merged) -> None:
        """Queue the merge of the streamed layer that ran after `layer` last time, where it is in the
        same block (its weight is this call's slot view already) and the request targets it."""
        nxt = self.ahead.learn(layer, self.streamed[layer])
        if nxt is None or nxt not in self._active or nxt in self._swapped:
            return
        b, factor = self._active[nxt]
        self.ahead.queue(nxt, b, factor, nxt._parameters["weight"], nxt._parameters.get("bias"), merged, self.scratch,
                         self.way)

    def _merge(self, layer: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> Merged:
        """`layer`'s merge for the running request, in new tensors kept by the cache where the layer
        is resident and the cache has room, else in the scratch."""
        assert self.scratch is not None
        b, factor = self._active[layer]
        blocks = self.block_merges if self.block_merges is not None and self.block_merges.holds(layer) else None
        kept = self._cache_room(layer, weight, bias, b)  # None for a streamed layer
        if kept is not None:
            into = kept
        elif blocks is not None:
            into = blocks.views_for(layer, b, weight, bias)
        else:
            into = self.scratch.views_for(b, weight, bias)
        merged = merge_layer(into, weight, bias, b, factor, self.way)
        if kept is not None and self.cache is not None:
            self.cache.keep(self._key, layer, merged)
        elif blocks is not None:
            blocks.keep(layer, weight, bias, merged)
        return merged

    def _cache_room(self, layer: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None,
                    b: Branch) -> Merged | None:
        """New tensors (weight, bias or None) to keep `layer`'s merge in, where it is resident and the
        cache has room for them; else None. Shaped, typed and flagged as the scratch's views are."""
        if self.cache is None or layer in self.streamed:
            return None
        out, dtype = b.B.shape[0], b.B.dtype
        nbytes = merge_bytes(out, b.A.shape[1], b.bias is not None, dtype.itemsize)
        if not self.cache.room_for(self._key, nbytes):
            return None
        device = weight.device
        kept = self.cache.new_parameter((out, b.A.shape[1]), dtype, device, weight.requires_grad)
        if kept is None:
            return None
        if b.bias is None:
            return kept, None
        kept_bias = self.cache.new_parameter((out,), dtype, device, bias is not None and bias.requires_grad)
        return None if kept_bias is None else (kept, kept_bias)

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
        if self.ahead is not None:
            self.ahead.close()
            self.ahead = None
        if self.block_merges is not None:
            self.block_merges.close()
            self.block_merges = None
        if self.cache is not None:
            self.cache.close()
            self.cache = None
