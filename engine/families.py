"""Model families: which module lists are the offloaded blocks, and how checkpoint keys group.

Owns: the registry from a diffusers `_class_name` to its block lists (execution order), and the
torch-free model facts (bytes, blocks, largest block) the agent and operator use.
Must never: import torch or diffusers (the agent and operator import this module).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from dlo.engine.checkpoint import Checkpoint, CheckpointError
from dlo.engine.facts import ModelFacts
from dlo.engine.layout import BlockLayout, build_layout


@dataclass(frozen=True)
class Family:
    name: str
    class_names: tuple[str, ...]
    # Attribute names of the nn.ModuleLists holding the blocks, in the order forward runs them.
    block_lists: tuple[str, ...]
    pipeline_class: str


FAMILIES: dict[str, Family] = {
    "wan": Family("wan", ("WanTransformer3DModel",), ("blocks",), "WanPipeline"),
    "flux": Family(
        "flux",
        ("FluxTransformer2DModel",),
        ("transformer_blocks", "single_transformer_blocks"),
        "FluxPipeline",
    ),
}


def family_of(class_name: str) -> Family:
    for fam in FAMILIES.values():
        if class_name in fam.class_names:
            return fam
    known = sorted(c for f in FAMILIES.values() for c in f.class_names)
    raise KeyError(f"model class {class_name!r} has no DLO family; known: {', '.join(known)}")


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


def group_keys(names: list[str] | set[str], family: Family) -> tuple[list[BlockKeys], list[str]]:
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


def read_config(component_dir: Path | str) -> dict:
    path = Path(component_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(path, f"unreadable model config: {e}") from e
    if not isinstance(config, dict) or "_class_name" not in config:
        raise CheckpointError(path, "config.json has no _class_name (is this a diffusers model folder?)")
    return config


def block_layout(ckpt: Checkpoint, block: BlockKeys, dtype_of: Mapping[str, str] | None = None) -> BlockLayout:
    """The block's slot layout (CONTRACTS.md section 4), tensors in file order so that runs stay
    contiguous with the file. `dtype_of` gives the dtype the model computes a tensor in where it
    differs from the stored one (a cast on load)."""
    infos = sorted((ckpt.tensors[k] for k in block.keys), key=lambda i: (str(i.path), i.start))
    dtype_of = dtype_of or {}
    return build_layout([(i.name, dtype_of.get(i.name, i.dtype), i.shape) for i in infos])


def describe(component_dir: Path | str) -> ModelFacts:
    """Model facts of a transformer folder (or of a pipeline folder's `transformer/`)."""
    root = Path(component_dir)
    if (root / "model_index.json").is_file() and (root / "transformer").is_dir():
        root = root / "transformer"
    family = family_of(read_config(root)["_class_name"])
    ckpt = Checkpoint(root)
    blocks, nonblock = group_keys(set(ckpt.tensors), family)
    sizes = [block_layout(ckpt, b).nbytes for b in blocks]
    return ModelFacts(
        family=family.name,
        bytes=ckpt.nbytes,
        blocks=len(blocks),
        largest_block_bytes=max(sizes, default=0),
        nonblock_bytes=sum(ckpt.tensors[k].nbytes for k in nonblock),
    )
