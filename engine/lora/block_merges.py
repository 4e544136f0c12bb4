"""The merges of the streamed block that ran last, kept for the call that runs it again next.

Owns: `BlockMerges` (one buffer per position of an adapted layer in a streamed block, and which
layer's merge each holds now).
Must never: hand out a merge made from another weight than the one bound now, or outlive the
request (the next may name another adapter or scale).

[Note: a block's merges kept] Under CFG pairs (`dlo.engine.cfg_pairs`) the uncond lane runs each
streamed block right after the cond lane, from the same slot, with the same adapter and scale: its
merges are the cond lane's, bit for bit. So each position of an adapted layer in a block gets its own
buffer (Wan2.1-14B, rank 64 on every block linear: ten, 0.70 GB in bfloat16, where the per-layer
scratch and the look-ahead's hold 0.28), the cond lane merges into it, and the uncond lane takes
that merge where the layer and its bound weight are the very objects it was made for; the next
block's layer at that position overwrites it. Half the merges of a paired step; the look-ahead
([Note: merging ahead]) is not used with it (measured on an H100 it hid nothing: record
`lora-merge-overlap-2026-12-06-queued`). Unpaired calls find another block's merge at every position
and merge as before.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from dlo.engine.lora.merge import Merged, MergeScratch
from dlo.engine.lora.weights import Branch


class BlockMerges:
    """Per position of an adapted streamed layer in its block: a buffer, and the merge it holds."""

    def __init__(self, streamed: Mapping[nn.Module, int], adapters: Mapping[str, Mapping[nn.Module, Branch]],
                 device: torch.device):
        """`streamed`: layer -> block, each block's modules in their order; `adapters`: every adapter's
        branches by layer."""
        adapted = {layer for branches in adapters.values() for layer in branches}
        self.position: dict[nn.Module, int] = {}
        counts: dict[int, int] = {}
        for layer, block in streamed.items():
            if layer in adapted:
                self.position[layer] = counts.get(block, 0)
                counts[block] = self.position[layer] + 1
        at: dict[int, list[Branch]] = {}
        for branches in adapters.values():
            for layer, b in branches.items():
                if layer in self.position:
                    at.setdefault(self.position[layer], []).append(b)
        self.buffers = {p: MergeScratch(bs, device) for p, bs in at.items()}
        self._held: dict[int, tuple[nn.Module, Any, Any, Merged]] = {}  # position -> layer, weight, bias, merge
        self.taken = 0  # merges handed out instead of made (the tests read it)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.buffers.values())

    def holds(self, layer: nn.Module) -> bool:
        """Whether `layer` merges into a buffer of its position."""
        return layer in self.position

    def views_for(self, layer: nn.Module, b: Branch, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
        return self.buffers[self.position[layer]].views_for(b, weight, bias)

    def keep(self, layer: nn.Module, weight: Any, bias: Any, merged: Merged) -> None:
        self._held[self.position[layer]] = (layer, weight, bias, merged)

    def take(self, layer: nn.Module, weight: Any, bias: Any) -> Merged | None:
        """`layer`'s merge from exactly this `weight` and `bias`, where its position still holds it."""
        held = self._held.get(self.position.get(layer, -1))
        if held is None or held[0] is not layer or held[1] is not weight or held[2] is not bias:
            return None
        self.taken += 1
        return held[3]

    def forget(self) -> None:
        self._held.clear()

    def close(self) -> None:
        self.forget()
        for s in self.buffers.values():
            s.close()
        self.buffers = {}
