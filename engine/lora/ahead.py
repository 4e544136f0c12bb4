"""The next streamed layer's merge, made on a side stream while the current layer computes.

Owns: `MergeAhead` (the order streamed layers ran in last time, one pending merge, its own scratch).
`LoraBank` asks it, in a streamed layer's pre-hook, for the merge queued for that layer (`take`),
then queues the merge of the layer that followed it last time in the same block (`queue`).
Must never: hand out a merge made from another weight than the one bound now, queue a merge into
the buffer the running layer computes from, or leave a merge in flight that a later write could race.

[Note: merging ahead] A streamed layer's merge (Wan2.1-14B: ~2.8 GB of HBM traffic a block, 4-5% of
a request at 832x480x17 with every block streamed: `bench/results/lora-h200-2026-12-04.md`) is
memory-bound, the layers it hides behind (GEMMs, attention) compute-bound. Within one block every
layer's weight is this call's slot view from the block's start, so the merge of layer k+1 can run
while layer k computes. Ordering, with events only: the side stream waits an event recorded on the
compute stream when it is queued (after the block's copy wait, after every earlier use of the
buffer it writes), the compute stream waits the merge's own event before the layer runs, and the
slot is not refilled before the block's end, which the compute stream reaches after that wait. The
two buffers alternate: the merge goes into the one the running layer is not computing from. A
prediction that misses (another layer, another weight) is waited for and dropped, and the layer
merges as before: the same kernels in the same order, so the same bytes. On a device without streams
(`stream` None: the tests on cpu) the queued merge is made at once, the same logic without overlap.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from dlo.engine.lora.merge import TWO_STEPS, Merged, MergeScratch, MergeWay, merge_layer
from dlo.engine.lora.weights import Branch


class MergeAhead:
    """One rank's look-ahead merges of streamed layers ([Note: merging ahead])."""

    def __init__(self, scratch: MergeScratch, stream: Any = None):
        self.scratch = scratch  # the second buffer: the bank's own scratch is the first
        self.stream = stream  # a cuda stream, None to merge at once
        self.hits = 0  # merges taken as queued (the tests read it)
        self._next: dict[nn.Module, nn.Module] = {}  # layer -> the layer that ran after it, same block
        self._last: tuple[nn.Module, int] | None = None
        self._pending: tuple[nn.Module, Any, Any, Merged, Any] | None = None  # layer, weight, bias, merge, event
        # made once, recorded per merge: the side stream's wait and the merge's own (one in flight at a time)
        self._queued, self._done = (torch.cuda.Event(), torch.cuda.Event()) if stream is not None else (None, None)

    @classmethod
    def on(cls, branches: Iterable[Branch], device: torch.device) -> "MergeAhead | None":
        """A look-ahead for `branches` on `device`, None where the device has no streams to overlap on."""
        if device.type != "cuda":
            return None
        return cls(MergeScratch(branches, device), torch.cuda.Stream(device))

    def learn(self, layer: nn.Module, block: int) -> nn.Module | None:
        """Note that `layer` of `block` runs now; the layer that followed it last time, if any."""
        if self._last is not None and self._last[1] == block:
            self._next[self._last[0]] = layer
        elif self._last is not None:  # the block ended after it this time: nothing to merge ahead of it
            self._next.pop(self._last[0], None)
        self._last = (layer, block)
        return self._next.get(layer)

    def queue(self, layer: nn.Module, b: Branch, factor: Any, weight: Any, bias: Any, running: Merged,
              main: MergeScratch, way: MergeWay = TWO_STEPS) -> None:
        """Merge `layer`'s bound `weight` (and `bias`) with `b` into the buffer `running` is not in."""
        self.drop()
        target = main if self.scratch.holds(running[0]) else self.scratch
        into = target.views_for(b, weight, bias)
        if self.stream is None:
            self._pending = (layer, weight, bias, merge_layer(into, weight, bias, b, factor, way), None)
            return
        self._queued.record()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self._queued)
            merged = merge_layer(into, weight, bias, b, factor, way)
            self._done.record(self.stream)
        self._pending = (layer, weight, bias, merged, self._done)

    def take(self, layer: nn.Module, weight: Any, bias: Any) -> Merged | None:
        """The merge queued for `layer` from exactly this `weight` and `bias`, ordered before what the
        compute stream runs next; None (and nothing in flight) where the queued one is another's."""
        pending = self._pending
        self.drop()
        if pending is None or pending[0] is not layer or pending[1] is not weight or pending[2] is not bias:
            return None
        self.hits += 1
        return pending[3]

    def drop(self) -> None:
        """Order the compute stream after the merge in flight, if any, and forget it."""
        if self._pending is not None and self._pending[4] is not None:
            torch.cuda.current_stream().wait_event(self._pending[4])
        self._pending = None

    def end_request(self) -> None:
        self.drop()
        self._last = None

    def close(self) -> None:
        self.drop()
        self._next.clear()
        self.scratch.close()
