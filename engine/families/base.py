"""The offload half of the family contract: what `dlo.engine.load` needs to know of a model class.

Owns: `BlockFamily` (a model class's block lists in execution order, and the classes that have
them) and `read_config` (a component's config.json, diffusers or transformers). The serving half
(pipeline class, call plan, call kwargs and inputs, decoding, streamable encoders, pipeline facts)
is `dlo.engine.families.pipelines`; the tiny-model writers are `dlo.engine.families.tiny_writers`.
Must never: import torch, diffusers or numpy (the agent and operator import it), or know about
pipelines, requests, HTTP, queues or ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dlo.engine.checkpoint import CheckpointError, read_json_config


def class_fields_error(config: dict) -> str | None:
    """What is wrong with the fields a model's class is read from (diffusers' `_class_name`, a
    string; transformers' `architectures`, a non-empty list of strings), or None."""
    name, arch = config.get("_class_name"), config.get("architectures")
    if name is not None and not isinstance(name, str):
        return f"_class_name must be a string, got {type(name).__name__}"
    if arch is not None and not (isinstance(arch, list) and arch and all(isinstance(a, str) for a in arch)):
        return f"architectures must be a non-empty list of class names, got {str(arch)[:60]}"
    return None


def read_config(component_dir: Path | str) -> dict:
    """A model component's config.json (must name its diffusers `_class_name`, or transformers'
    `architectures`: then `_class_name` is the first of them and `_library` is "transformers")."""
    path = Path(component_dir) / "config.json"
    config = read_json_config(path)
    wrong = class_fields_error(config)
    if wrong is not None:
        raise CheckpointError(path, wrong)
    if "_class_name" not in config and config.get("architectures"):
        # a transformers model (text encoder): its class is the first of `architectures`
        config = {**config, "_class_name": config["architectures"][0], "_library": "transformers"}
    if "_class_name" not in config:
        raise CheckpointError(path, "config.json has no _class_name or architectures (is this a model folder?)")
    return config


@dataclass(frozen=True)
class BlockFamily:
    """What the offload streams of a model class: its block lists, in the order forward runs them.

    `name` is the family of `ModelFacts.family` (`describe`); `class_names` the model classes
    (config.json `_class_name`, or a transformers class of `architectures`) that have these lists;
    `block_lists` the attribute paths of the nn.ModuleLists holding the blocks (dotted paths allowed).
    Two placements of non-block modules beside "resident on the device" (dotted module paths; their
    weights are views of the host page cache, never copied to the device, in every mode):
    `unused`, modules the forward never calls (Cosmos3's `lm_head`: a 1.24 GB vocabulary head of a
    transformer that only denoises); `host_lookups`, embedding tables looked up on the host, only
    the rows a forward reads copied to the device (Cosmos3's `embed_tokens`, 1.24 GB, read for a few
    hundred prompt tokens per forward).
    """

    name: str
    class_names: tuple[str, ...]
    block_lists: tuple[str, ...]
    unused: tuple[str, ...] = ()
    host_lookups: tuple[str, ...] = ()

    def on_host(self, name: str) -> bool:
        """Whether checkpoint tensor `name` stays on the host (`unused` or `host_lookups`)."""
        return any(name.startswith(m + ".") for m in (*self.unused, *self.host_lookups))

    def __repr__(self) -> str:
        return f"BlockFamily({self.name!r})"
