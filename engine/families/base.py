"""The family adapter interface and the pipeline facts a request is validated against.

Owns: `Family` (what one model family knows: the block lists the offload streams, the diffusers
pipeline class, the pipeline facts of a folder, how many transformer calls a request makes for a
compatibility key, the pipeline call's keyword arguments, how its output is decoded into frames,
and how to write a tiny random folder of it), `PipelineFacts`, `Decoded`, and `read_config`.
Must never: import torch, diffusers or numpy at import time (adapters import them inside methods),
or know about HTTP, queues or ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlo.engine.checkpoint import CheckpointError, read_json_config

if TYPE_CHECKING:  # pragma: no cover
    from dlo.engine.serving.waves import Generation


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
class PipelineFacts:
    """What a request may ask of this pipeline folder (torch-free)."""

    family: str  # "wan" | "flux"
    pipeline_class: str
    size_multiple: int  # width and height must be multiples of this (VAE scale x patch)
    temporal_factor: int  # video frames must be temporal_factor * k + 1; 0: images only
    default_guidance: float
    transformer_class: str
    # the pipeline's transformer components, each streamed by its own `dlo.engine.load` (Wan2.2: two experts)
    transformers: tuple[str, ...] = ("transformer",)
    image_input: bool = False  # image-to-video: a request must bring an input image

    @classmethod
    def from_dir(cls, model_dir: Path | str) -> "PipelineFacts":
        """`dlo.engine.families.pipeline_facts(model_dir)`."""
        from dlo.engine.families import pipeline_facts

        return pipeline_facts(model_dir)

    @property
    def supports_video(self) -> bool:
        return self.temporal_factor > 0

    @property
    def adapter(self) -> "Family":
        from dlo.engine.families import FAMILIES

        return FAMILIES[self.family]

    def valid_frames(self, seconds: float, fps: int) -> int:
        """The family's valid frame count nearest to seconds x fps (Wan: 4k+1), at least 1."""
        if not self.supports_video:
            raise ValueError(f"{self.pipeline_class} makes images only")
        t = self.temporal_factor
        want = max(1.0, seconds * fps)
        k = max(0, math.floor((want - 1) / t + 0.5))  # ties round up: never shorter than asked
        return t * k + 1

    def uses_cfg(self, gen: "Generation") -> bool:
        """Whether the pipeline runs a separate unconditional transformer call per step."""
        return self.adapter.uses_cfg(gen)

    def transformer_calls(self, gen: "Generation") -> int:
        """Transformer forwards one request makes: steps x CFG branches (separate calls)."""
        return self.adapter.transformer_calls(gen)


@dataclass(frozen=True)
class Decoded:
    """A pipeline's output as float frames in [0, 1]: one video (frames, H, W, 3) or images (H, W, 3)."""

    images: tuple[Any, ...] = ()
    video: Any = None


class Family:
    """One model family's adapter. Subclasses set the class attributes and implement the methods."""

    name: str = ""
    class_names: tuple[str, ...] = ()  # transformer classes (config.json `_class_name`)
    # Attribute names of the nn.ModuleLists holding the blocks, in the order forward runs them.
    block_lists: tuple[str, ...] = ()
    pipeline_class: str = ""  # diffusers pipeline class (model_index.json `_class_name`)

    def __repr__(self) -> str:
        return f"Family({self.name!r})"

    # ---- serving: what a request means for this pipeline -----------------------------------------
    def matches(self, index: dict) -> bool:
        """Whether this adapter serves the pipeline folder whose model_index.json is `index`."""
        return index.get("_class_name") == self.pipeline_class

    def pipeline_facts(self, root: Path, index: dict, transformer: dict, vae: dict) -> PipelineFacts:
        raise NotImplementedError

    def call_plan(self, gen: "Generation", pipe: Any) -> list[tuple[str, int]]:
        """Transformer forwards one request makes, per transformer component, in the order they run
        (what an idle rank walks with `gather_only`; `pipe` is the loaded diffusers pipeline)."""
        return [("transformer", self.transformer_calls(gen))]

    # Text encoders that may stream through the engine (`dlo serve --stream-text-encoders`), in the
    # order the pipeline calls them; each runs once for the prompt and once more for CFG's negative.
    streamable_encoders: tuple[str, ...] = ()

    def encoder_calls(self, gen: "Generation") -> int:
        """Forwards of each streamable text encoder per request (prompt, plus the negative with CFG)."""
        return 2 if self.uses_cfg(gen) else 1

    def call_inputs(self, gen: "Generation") -> dict[str, Any]:
        """Inputs of the pipeline call that are not plain JSON values (an input image); default none."""
        return {}

    def uses_cfg(self, gen: "Generation") -> bool:
        """Whether a request runs a separate unconditional transformer call per step."""
        return gen.guidance_scale > 1.0

    def transformer_calls(self, gen: "Generation") -> int:
        """Transformer forwards one request makes (what idle ranks pass to `gather_only`)."""
        return gen.steps * (2 if self.uses_cfg(gen) else 1)

    def call_kwargs(self, gen: "Generation") -> dict[str, Any]:
        """The family's own keyword arguments of the pipeline call (beyond prompt, size, steps, ...)."""
        raise NotImplementedError

    def decode(self, out: Any, gen: "Generation") -> Decoded:
        """The pipeline call's output (`output_type="np"`) as frames."""
        raise NotImplementedError

    # ---- tiny random models (tests, the demo, benchmarks) ---------------------------------------
    def tiny_transformer_config(self, layers: int, dim: int, head_dim: int, in_channels: int,
                                text_dim: int) -> dict:
        raise NotImplementedError

    def write_tiny_components(self, out: Path, seed: int, dtype: str) -> dict:
        """Write every component but the transformer into `out`; returns model_index.json's content."""
        raise NotImplementedError
