"""Model families: the one registry of family adapters, and the pipeline facts of a folder.

Owns: the registry (`FAMILIES`: the pipeline families `dlo serve` runs, one module each: `wan.py`,
`wan_i2v.py`, `wan22.py`, `flux.py`, `qwen_image.py`, `cosmos3.py`, `minimax_h3.py`; `BLOCK_FAMILIES`: the block lists the
offload streams, every pipeline's transformer and the streamed text encoders of
`text_encoders.py`), `family_of` (a model class's `BlockFamily`) and `pipeline_facts` (a folder's
`PipelineFacts`). The contract has two halves: `base.BlockFamily` (what the offload needs) and
`pipelines.PipelineFamily` (what serving needs); the tiny-model writers are `tiny_writers.py`; how
a checkpoint splits into blocks and the model facts of a folder are `dlo.engine.blocks`. Adding a
family is one module here (its `BlockFamily` and `PipelineFamily`), its entry below and its tests.
Must never: import torch or diffusers (the agent and operator import this package; adapters
import them inside the functions that need them), or import `dlo.serving`.
"""

from __future__ import annotations

from pathlib import Path

from dlo.engine.checkpoint import CheckpointError, read_json_config
from dlo.engine.families.base import BlockFamily, read_config
from dlo.engine.families.cosmos3 import Cosmos3Family
from dlo.engine.families.flux import FluxFamily
from dlo.engine.families.minimax_h3 import MiniMaxH3Family
from dlo.engine.families.pipelines import Decoded, PipelineFacts, PipelineFamily
from dlo.engine.families.qwen_image import QwenImageFamily
from dlo.engine.families.text_encoders import QWEN3_VL_ENCODER_BLOCKS, QWEN_VL_ENCODER_BLOCKS, T5_ENCODER_BLOCKS
from dlo.engine.families.wan import WanFamily
from dlo.engine.families.wan22 import Wan22Family
from dlo.engine.families.wan_i2v import WanI2VFamily

__all__ = [
    "BLOCK_FAMILIES", "FAMILIES", "BlockFamily", "Decoded", "PipelineFacts", "PipelineFamily", "family_of",
    "pipeline_facts", "pipeline_index", "read_config",
]

# Order matters where two adapters serve one pipeline class: Wan2.2 (two experts) before Wan2.1.
FAMILIES: dict[str, PipelineFamily] = {
    f.name: f for f in (Wan22Family(), WanFamily(), WanI2VFamily(), FluxFamily(), QwenImageFamily(), Cosmos3Family(),
                        MiniMaxH3Family())
}

# What the offload streams, by `BlockFamily.name`: the pipelines' transformers (Wan's serves three
# pipelines), then the text encoders that stream but are no pipeline.
BLOCK_FAMILIES: dict[str, BlockFamily] = {
    b.name: b for b in (*(f.blocks for f in FAMILIES.values()), T5_ENCODER_BLOCKS, QWEN_VL_ENCODER_BLOCKS,
                        QWEN3_VL_ENCODER_BLOCKS)
}


def family_of(class_name: str) -> BlockFamily:
    """The block lists of a model class (`_class_name` of its config.json, or a transformers class of
    `architectures`); KeyError names the known ones."""
    for fam in BLOCK_FAMILIES.values():
        if class_name in fam.class_names:
            return fam
    known = sorted(c for f in BLOCK_FAMILIES.values() for c in f.class_names)
    raise KeyError(f"model class {class_name!r} has no DLO family; known: {', '.join(known)}")


def pipeline_index(root: Path) -> Path:
    """A pipeline folder's index: `model_index.json`, or a modular pipeline's `modular_model_index.json`
    (MiniMax-H3 has only that one)."""
    modular = root / "modular_model_index.json"
    return modular if modular.is_file() and not (root / "model_index.json").is_file() else root / "model_index.json"


def pipeline_facts(model_dir: Path | str) -> PipelineFacts:
    """What a request may ask of a pipeline folder, from its configs (torch-free; ValueError if unsupported)."""
    root = Path(model_dir)
    try:
        index = read_json_config(pipeline_index(root))
        transformer = read_json_config(root / "transformer" / "config.json")
        vae = read_json_config(root / "vae" / "config.json")
    except CheckpointError as e:
        raise ValueError(
            f"{root} is not a diffusers pipeline folder (model_index.json or modular_model_index.json, "
            f"transformer/ and vae/ with config.json): {e}"
        ) from e
    name = index.get("_class_name")
    for fam in FAMILIES.values():
        if fam.matches(index):
            return fam.pipeline_facts(root, index, transformer, vae)
    supported = ", ".join(sorted({f.pipeline_class for f in FAMILIES.values()}))
    raise ValueError(f"{root}: pipeline class {name!r} is not supported; supported: {supported}")
