"""The serving half of the family contract: what a request means for one diffusers pipeline.

Owns: `PipelineFamily` (a pipeline family's adapter: the diffusers pipeline class, the transformer's
`BlockFamily`, the text encoders that may stream, which folders it serves, their `PipelineFacts`,
the call plan a request implies, the pipeline call's keyword arguments and non-JSON inputs, and how
its output decodes into frames), `PipelineFacts` (what a request is validated against) and `Decoded`.
The offload half (block lists) is `dlo.engine.families.base`.
Must never: import torch, diffusers, numpy or PIL at import time (adapters import them inside
methods), import `dlo.engine.serving`, or know about HTTP, queues or ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlo.engine.families.base import BlockFamily
from dlo.engine.request import Generation


@dataclass(frozen=True)
class PipelineFacts:
    """What a request may ask of this pipeline folder (torch-free)."""

    family: str  # a `FAMILIES` name: "wan", "wan2.2", "wan-i2v", "flux", "qwen-image"
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
    def adapter(self) -> "PipelineFamily":
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

    def uses_cfg(self, gen: Generation) -> bool:
        """Whether the pipeline runs a separate unconditional transformer call per step."""
        return self.adapter.uses_cfg(gen)

    def transformer_calls(self, gen: Generation) -> int:
        """Transformer forwards one request makes: steps x CFG branches (separate calls)."""
        return self.adapter.transformer_calls(gen)


@dataclass(frozen=True)
class Decoded:
    """A pipeline's output as float frames in [0, 1]: one video (frames, H, W, 3) or images (H, W, 3)."""

    images: tuple[Any, ...] = ()
    video: Any = None


class PipelineFamily:
    """One pipeline family's adapter. Subclasses set the class attributes and implement
    `pipeline_facts`, `call_kwargs` and `decode`; the other methods have the common behaviour."""

    name: str = ""
    pipeline_class: str = ""  # diffusers pipeline class (model_index.json `_class_name`)
    blocks: BlockFamily  # the transformer's block lists (what `dlo.engine.load` streams)
    # Text encoders that may stream through the engine (`dlo serve --stream-text-encoders`), in the
    # order the pipeline calls them; each runs once for the prompt and once more for CFG's negative.
    streamable_encoders: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"PipelineFamily({self.name!r})"

    def matches(self, index: dict) -> bool:
        """Whether this adapter serves the pipeline folder whose model_index.json is `index`."""
        return index.get("_class_name") == self.pipeline_class

    def pipeline_facts(self, root: Path, index: dict, transformer: dict, vae: dict) -> PipelineFacts:
        raise NotImplementedError

    def call_plan(self, gen: Generation, pipe: Any) -> list[tuple[str, int]]:
        """Transformer forwards one request makes, per transformer component, in the order they run
        (what an idle rank walks with `gather_only`; `pipe` is the loaded diffusers pipeline)."""
        return [("transformer", self.transformer_calls(gen))]

    def encoder_calls(self, gen: Generation) -> int:
        """Forwards of each streamable text encoder per request (prompt, plus the negative with CFG)."""
        return 2 if self.uses_cfg(gen) else 1

    def call_inputs(self, gen: Generation) -> dict[str, Any]:
        """Inputs of the pipeline call that are not plain JSON values (an input image); default none."""
        return {}

    def uses_cfg(self, gen: Generation) -> bool:
        """Whether a request runs a separate unconditional transformer call per step."""
        return gen.guidance_scale > 1.0

    def transformer_calls(self, gen: Generation) -> int:
        """Transformer forwards one request makes (what idle ranks pass to `gather_only`)."""
        return gen.steps * (2 if self.uses_cfg(gen) else 1)

    def call_kwargs(self, gen: Generation) -> dict[str, Any]:
        """The family's own keyword arguments of the pipeline call (beyond prompt, size, steps, ...)."""
        raise NotImplementedError

    def decode(self, out: Any, gen: Generation) -> Decoded:
        """The pipeline call's output (`output_type="np"`) as frames."""
        raise NotImplementedError
