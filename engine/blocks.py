"""A model's blocks: how a checkpoint's keys split into blocks, each block's slot layout, and the
model facts of a folder. Torch-free (the agent and operator read model facts without a weight).

Owns: `BlockKeys` and `group_keys` (checkpoint names into blocks in execution order and non-block
names, by a `BlockFamily`'s block lists), `block_layout` (a block's slot layout, docs/contracts.md
section 4, over `dlo.engine.layout`), and `describe` (the `ModelFacts` of a transformer folder).
Must never: import torch, or read more of a checkpoint than its headers (`describe` is called by
the agent's scans and `dlo plan`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from dlo.engine.checkpoint import Checkpoint, cached_checkpoint
from dlo.plan.facts import ModelFacts
from dlo.engine.families import BlockFamily, family_of, pipeline_index, read_config
from dlo.engine.layout import BlockLayout, build_layout


@dataclass(frozen=True)
class BlockKeys:
    """One block: where it sits (`list_name[index]`) and its checkpoint keys (name relative to it)."""

    order: int  # position in execution order across all block lists
    list_name: str
    index: int
    keys: tuple[str, ...]  # full checkpoint names

    @property
    def prefix(self) -> str:
        return f"{self.list_name}.{self.index}."


def group_keys(names: list[str] | set[str], family: BlockFamily) -> tuple[list[BlockKeys], list[str]]:
    """Split checkpoint names into blocks (execution order) and non-block names."""
    pattern = re.compile(r"^(" + "|".join(map(re.escape, family.block_lists)) + r")\.(\d+)\.")
    grouped: dict[tuple[int, int], list[str]] = {}
    nonblock: list[str] = []
    for name in sorted(names):
        m = pattern.match(name)
        if m is None:
            nonblock.append(name)
            continue
        key = (family.block_lists.index(m.group(1)), int(m.group(2)))
        grouped.setdefault(key, []).append(name)
    blocks = [
        BlockKeys(order, family.block_lists[li], idx, tuple(keys))
        for order, ((li, idx), keys) in enumerate(sorted(grouped.items()))
    ]
    return blocks, nonblock


def block_layout(ckpt: Checkpoint, block: BlockKeys, dtype_of: Mapping[str, str] | None = None) -> BlockLayout:
    """The block's slot layout (docs/contracts.md section 4), tensors in file order so that runs stay
    contiguous with the file. `dtype_of` gives the dtype the model computes a tensor in where it
    differs from the stored one (a cast on load)."""
    infos = sorted((ckpt.tensors[k] for k in block.keys), key=lambda i: (str(i.path), i.start))
    dtype_of = dtype_of or {}
    return build_layout([(i.name, dtype_of.get(i.name, i.dtype), i.shape) for i in infos])


def describe(component_dir: Path | str, stream_dtype: str = "bfloat16") -> ModelFacts:
    """Model facts of a transformer folder (or of a pipeline folder's `transformer/`), its blocks
    streamed as `stream_dtype` (`dlo.engine.fp8`: a folder of FP8 weights streams them whatever it is)."""
    from dlo.engine.fp8 import compute_bytes, dequant_bytes, fp8_plan, wire_layout

    root = Path(component_dir)
    if pipeline_index(root).is_file() and (root / "transformer").is_dir():
        root = root / "transformer"
    family = family_of(read_config(root)["_class_name"])
    ckpt = cached_checkpoint(root)
    names = set(ckpt.tensors)
    blocks, nonblock = group_keys(names, family)
    fp8 = fp8_plan(ckpt, (k for b in blocks for k in b.keys), stream_dtype)
    facts = ModelFacts(family=family.name, bytes=ckpt.nbytes, blocks=len(blocks),
                       largest_block_bytes=max((block_layout(ckpt, b).nbytes for b in blocks), default=0),
                       nonblock_bytes=sum(ckpt.tensors[k].nbytes for k in nonblock))
    if fp8 is None:
        return facts
    # the scales of a stored FP8 folder are block tensors of their own in the checkpoint: not the model's
    blocks, _ = group_keys(names - fp8.scales, family)
    wires = [wire_layout(ckpt, b.keys, {}, fp8) for b in blocks]
    return dataclasses.replace(
        facts, largest_block_bytes=max((lay.nbytes for lay, _ in wires), default=0),
        dequant_bytes=max((dequant_bytes(pieces) for _, pieces in wires), default=0),
        compute_block_bytes=max((compute_bytes(ckpt, b.keys, fp8) for b in blocks), default=0),
        compute_bytes=compute_bytes(ckpt, names, fp8))
