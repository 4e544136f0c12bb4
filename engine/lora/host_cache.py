"""Streamed blocks merged with an adapter, kept in host memory and copied into the slot in their place.

Owns: `HostMergeCache` (per (adapter, scale), the merged weights and biases of each streamed block's
targeted layers in pinned host memory, up to a byte budget, the least recently used (adapter, scale)
dropped first; the prefetcher's other source for a block, `[Note: a slot's other source]`) and
`overlay` (a block's host runs with some byte ranges taken from other tensors).
Must never: serve a block before every one of its merges has landed on the host, free host bytes a
copy may still read, or be used where a slot is shared (allgather) or holds FP8 weights (the
settings refuse both: `EngineSettings`).

[Note: the host merge cache] A streamed layer's merge (`--lora-apply merge`) is made per call: the
slot holds this call's copy of the block, and merging it costs a pass over the block's weights on
the compute stream (~0.7 ms a Wan2.1-14B block, what a video's block copy leaves no room for). The
merged weight of a streamed layer is the same tensor every call for one (adapter, scale), so with
`--lora-host-cache BYTES` the first call's merges are copied to the host (device to host, on the
compute stream right after each merge: the scratch is reused by the next layer) and the block's
later copies take those bytes instead of the checkpoint's: the slot then holds the merged block, the
layers run with no merge and no swap, and a request costs what the base model costs wherever the
copies hide behind compute. Bytes: the same tensors the scratch held, so the same output as the
uncached merge (`fuse_lora`'s). Block 0 is copied by the previous call's last block, before the next
request is known: it keeps its own bytes and merges per call. Memory: host bytes, the targeted
weights of the streamed blocks once per cached (adapter, scale) (~28 GB for a rank-64 adapter of
every Wan2.1-14B block linear), pinned where the platform allows; the first call with an adapter
pays the device-to-host copies (~0.5 s a Wan2.1 forward) and the host allocations.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from dlo.engine.transfers import Copies

log = logging.getLogger(__name__)

Key = tuple[str, float]  # (adapter, scale)


def overlay(runs: Copies, patches: Iterable[tuple[int, torch.Tensor]]) -> Copies:
    """`runs` (host bytes, offset) covering a block, with each patch (offset, bytes) copied instead of
    what the runs hold there; patches must not overlap each other."""
    patches = sorted(patches, key=lambda p: p[0])
    out: Copies = []
    for src, off in runs:
        end, at = off + src.numel(), off
        for p_off, p_src in patches:
            p_end = p_off + p_src.numel()
            if p_end <= at or p_off >= end:
                continue
            if p_off > at:
                out.append((src[at - off : p_off - off], at))
            at = max(at, min(p_end, end))
        if at < end:
            out.append((src[at - off :], at))
    for p_off, p_src in patches:
        out.append((p_src, p_off))
    return sorted(out, key=lambda c: c[1])


@dataclass(frozen=True)
class Place:
    """Where a targeted streamed layer's tensors sit in its block's slot: (byte offset, bytes) each."""

    block: int
    weight: tuple[int, int]
    bias: tuple[int, int] | None  # its own bias (None: it has none)


@dataclass
class _Block:
    """One block's merges for one (adapter, scale) on the host, in one buffer."""

    waiting: set  # layers whose merge has not been copied yet
    buffer: torch.Tensor
    pinned: bool
    at: int = 0  # bytes of `buffer` used so far
    patches: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    event: Any = None  # recorded after the last copy
    copies: Copies | None = None  # the block's runs with the merges in place, once complete


class HostMergeCache:
    """Merged streamed blocks per (adapter, scale) on the host, up to `capacity` bytes
    ([Note: the host merge cache])."""

    def __init__(self, capacity: int, prefetcher: Any, platform: Any, places: dict[nn.Module, Place]):
        assert prefetcher.g == 1, "a host merge is a whole block: one rank's own slot"
        self.capacity, self.used = capacity, 0
        self.prefetcher, self.platform, self.places = prefetcher, platform, places
        self._entries: OrderedDict[Key, dict[int, _Block]] = OrderedDict()
        self._key: Key | None = None
        self._blocks: dict[int, dict[nn.Module, int]] = {}  # the running request's layers per block: their bytes
        self._full: set[int] = set()  # blocks the running request found no room for
        self._unpinned_said = False

    @classmethod
    def for_model(cls, capacity: int, model: Any) -> "HostMergeCache":
        """For the streamed blocks of the `OffloadedModel` `model`; becomes its prefetcher's other source."""
        prefetcher = model.prefetcher
        tensors = {t.name: (j, (t.offset, t.end - t.offset))
                   for j, b in enumerate(prefetcher.blocks) for t in b.layout.tensors}
        places = {}
        for name, layer in model.module.named_modules():
            w = tensors.get(f"{name}.weight")
            if w is not None:
                bias = tensors.get(f"{name}.bias")
                places[layer] = Place(w[0], w[1], bias[1] if bias is not None else None)
        cache = cls(capacity, prefetcher, model.platform, places)
        prefetcher.sources = cache
        return cache

    # ---- a request ---------------------------------------------------------------------------------
    def begin(self, key: Key, layers: dict[nn.Module, tuple[int, int | None]]) -> None:
        """Requests for adapter and scale `key` run from now on; `layers`: each targeted layer's merged
        (weight bytes, bias bytes or None where the adapter merges no bias)."""
        self._key, self._blocks, self._full = key, {}, set()
        for layer, (w, b) in layers.items():
            place = self.places.get(layer)
            # cacheable where the merge fits the slot's own tensors (a merged bias needs the layer's own)
            if place is not None and w == place.weight[1] and (b is None or (place.bias and b == place.bias[1])):
                self._blocks.setdefault(place.block, {})[layer] = w + (b or 0)
        if key in self._entries:
            self._entries.move_to_end(key)

    def end(self) -> None:
        self._key, self._blocks = None, {}

    def in_slot(self, layer: nn.Module) -> bool:
        """Whether `layer`'s slot holds it merged for the running request (no merge, no swap)."""
        place = self.places.get(layer)
        return (place is not None and self._key is not None and layer in self._blocks.get(place.block, ())
                and self.prefetcher.tag_of(place.block) == self._key)

    def source(self, i: int) -> tuple[Copies, Key] | None:
        """Block i merged for the running request, once every merge of it has landed on the host."""
        if self._key is None:
            return None
        blk = self._entries.get(self._key, {}).get(i)
        if blk is None or blk.copies is None or not self.platform.done(blk.event):
            return None
        return blk.copies, self._key

    def keep(self, layer: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Copy `layer`'s merge for the running request (made now in the scratch: `weight`, and `bias`
        where the adapter merges one) to the host, where its block has room; on the current stream."""
        place = self.places.get(layer)
        if place is None or self._key is None or layer not in self._blocks.get(place.block, ()):
            return
        blk = self._block(place.block)
        if blk is None or layer not in blk.waiting:
            return
        for where, t in ((place.weight, weight), (place.bias, bias)):
            if t is None:
                continue
            n = t.numel() * t.element_size()
            host = blk.buffer[blk.at : blk.at + n]
            host.copy_(t.detach().reshape(-1).view(torch.uint8), non_blocking=True)
            blk.at += n
            blk.patches.append((where[0], host))
        blk.waiting.discard(layer)
        if not blk.waiting:
            blk.event = self.platform.new_event()
            self.platform.record(blk.event, self.platform.current_stream())
            blk.copies = overlay(self.prefetcher.copies[place.block], blk.patches)

    @property
    def keys(self) -> tuple[Key, ...]:
        return tuple(self._entries)

    # ---- room ---------------------------------------------------------------------------------------
    def _block(self, j: int) -> _Block | None:
        """The running request's entry for block j, made where there is room for all its merges."""
        entry = self._entries.setdefault(self._key, {})
        blk = entry.get(j)
        if blk is not None or j in self._full:
            return blk
        layers = self._blocks[j]
        nbytes = sum(layers.values())
        if not self._room_for(nbytes):
            self._full.add(j)
            return None
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        blk = entry[j] = _Block(set(layers), buffer, self._pin(buffer))
        self.used += nbytes
        return blk

    def _room_for(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit, after dropping the least recently used other keys (none is
        dropped for what would not fit even alone)."""
        own = sum(b.buffer.numel() for b in self._entries.get(self._key, {}).values())
        if nbytes > self.capacity - own:
            return False
        others = [k for k in self._entries if k != self._key]
        while self.used + nbytes > self.capacity and others:
            self._drop(others.pop(0))
        return self.used + nbytes <= self.capacity

    def _drop(self, key: Key) -> None:
        """Forget `key`'s merges, after every copy that may read them (rare: another adapter's first call)."""
        self.platform.synchronize()
        for blk in self._entries.pop(key).values():
            self.used -= blk.buffer.numel()
            self._release(blk)

    def _pin(self, t: torch.Tensor) -> bool:
        if not self.platform.has_streams:
            return False
        if self.platform.pin(t):
            return True
        if not self._unpinned_said:
            self._unpinned_said = True
            log.warning("lora host cache: pinning refused; its copies go through pageable memory (slower)")
        return False

    def _release(self, blk: _Block) -> None:
        if blk.pinned:
            self.platform.unpin(blk.buffer)
            blk.pinned = False

    def close(self) -> None:
        if self._entries:
            self.platform.synchronize()
        for key in list(self._entries):
            for blk in self._entries.pop(key).values():
                self._release(blk)
        self.used = 0
        self.prefetcher.sources = None
