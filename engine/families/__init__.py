"""Model families: the registry of family adapters, checkpoint key grouping, and model facts.

Owns: `Family` (the adapter interface: block lists in execution order, the diffusers pipeline
class, what a request implies for that pipeline, output decoding, the tiny-model writer), the
registry `FAMILIES` (one module per family: `wan.py`, `wan_i2v.py`, `wan22.py`, `flux.py`,
`qwen_image.py`), `family_of`, `group_keys` /
`BlockKeys`, the slot layout of a block (`block_layout`), the pipeline facts a request is validated
against (`PipelineFacts`), and `describe` (the torch-free `ModelFacts` the agent and operator use).
Adding a family is one module here and its tests.
Must never: import torch or diffusers at import time (the agent and operator import this package;
adapters import them inside the functions that need them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from dlo.engine.checkpoint import Checkpoint, CheckpointError, cached_checkpoint, read_json_config
from dlo.engine.facts import ModelFacts
from dlo.engine.families.base import Family, PipelineFacts, read_config
from dlo.engine.families.flux import FluxFamily
from dlo.engine.families.qwen_image import QwenImageFamily
from dlo.engine.families.text_encoders import QwenVLEncoderFamily, T5EncoderFamily
from dlo.engine.families.wan import WanFamily
from dlo.engine.families.wan22 import Wan22Family
from dlo.engine.families.wan_i2v import WanI2VFamily
from dlo.engine.layout import BlockLayout, build_layout

__all__ = [
    "FAMILIES", "BlockKeys", "Family", "ModelFacts", "PipelineFacts", "block_layout", "describe", "family_of",
    "group_keys", "pipeline_facts", "read_config",
]

# Order matters where two adapters serve one pipeline class: Wan2.2 (two experts) before Wan2.1.
FAMILIES: dict[str, Family] = {
    f.name: f for f in (Wan22Family(), WanFamily(), WanI2VFamily(), FluxFamily(), QwenImageFamily())
}

# Block-list adapters of components that stream but are no pipeline (text encoders).
ENCODER_FAMILIES: dict[str, Family] = {f.name: f for f in (T5EncoderFamily(), QwenVLEncoderFamily())}


def family_of(class_name: str) -> Family:
    """The family of a model class (`_class_name` of its config.json, or a transformers class of
    `architectures`); KeyError names the known ones."""
    for fam in (*FAMILIES.values(), *ENCODER_FAMILIES.values()):
        if class_name in fam.class_names:
            return fam
    known = sorted(c for f in (*FAMILIES.values(), *ENCODER_FAMILIES.values()) for c in f.class_names)
    raise KeyError(f"model class {class_name!r} has no DLO family; known: {', '.join(known)}")


def pipeline_facts(model_dir: Path | str) -> PipelineFacts:
    """What a request may ask of a pipeline folder, from its configs (torch-free; ValueError if unsupported)."""
    root = Path(model_dir)
    try:
        index = read_json_config(root / "model_index.json")
        transformer = read_json_config(root / "transformer" / "config.json")
        vae = read_json_config(root / "vae" / "config.json")
    except CheckpointError as e:
        raise ValueError(
            f"{root} is not a diffusers pipeline folder (model_index.json, transformer/ and vae/ "
            f"with config.json): {e}"
        ) from e
    name = index.get("_class_name")
    for fam in FAMILIES.values():
        if fam.matches(index):
            return fam.pipeline_facts(root, index, transformer, vae)
    supported = ", ".join(sorted({f.pipeline_class for f in FAMILIES.values()}))
    raise ValueError(f"{root}: pipeline class {name!r} is not supported; supported: {supported}")


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
    ckpt = cached_checkpoint(root)
    blocks, nonblock = group_keys(set(ckpt.tensors), family)
    sizes = [block_layout(ckpt, b).nbytes for b in blocks]
    return ModelFacts(
        family=family.name,
        bytes=ckpt.nbytes,
        blocks=len(blocks),
        largest_block_bytes=max(sizes, default=0),
        nonblock_bytes=sum(ckpt.tensors[k].nbytes for k in nonblock),
    )
