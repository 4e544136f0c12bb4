"""Serving limits: the largest request `dlo serve` accepts, read from a JSON/YAML file and flags.

Owns: the `Limits` model, its loading, and `sides` (a size field as width and height). Requests beyond a limit get a 400 naming the field and
the limit (see `dlo.engine.requests`); a small profile (size <= 128, steps <= 4) keeps tests fast.
Must never: import torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field


class Limits(BaseModel):
    """What one request may ask for. Defaults suit a real 14B-class model on one node."""

    model_config = ConfigDict(extra="forbid")

    max_width: int = Field(1920, ge=16, description="largest output width in pixels")
    max_height: int = Field(1920, ge=16, description="largest output height in pixels")
    max_steps: int = Field(100, ge=1, description="largest num_inference_steps")
    default_steps: int = Field(30, ge=1, description="num_inference_steps when a request gives none")
    max_n: int = Field(4, ge=1, description="largest number of images per request")
    max_frames: int = Field(129, ge=1, description="largest number of video frames")
    max_prompt_chars: int = Field(4000, ge=1, description="longest prompt or negative prompt, in characters")
    max_sequence_length: int = Field(
        512, ge=8, description="text tokens the encoders see (longer prompts are truncated); same on every rank"
    )
    max_guidance_scale: float = Field(30.0, ge=0, description="largest guidance_scale")
    video_fps: int = Field(16, ge=1, le=120, description="frames per second of generated videos")
    default_size: str = Field("1024x1024", pattern=r"^\d+x\d+$", description="size when a request gives none")
    default_video_size: str = Field("832x480", pattern=r"^\d+x\d+$", description="video size when none is given")
    max_body_bytes: int = Field(
        1024 * 1024, ge=1024, description="largest request body; larger ones get 413 before any of it is parsed"
    )
    max_reference_pixels: int = Field(
        4096 * 4096, ge=1, description="largest input_reference image (width x height, read from its header before "
                                       "it is decoded: what bounds the decode's cost)"
    )

    @classmethod
    def load(cls, path: Path | str | None = None, base: "Limits | None" = None, **overrides: object) -> "Limits":
        """`base` (default: the defaults), then the file (JSON or YAML), then non-None `overrides` (flags)."""
        data: dict = base.model_dump() if base is not None else {}
        if path is not None:
            text = Path(path).read_text()
            if str(path).endswith((".yaml", ".yml")):
                import yaml

                data.update(yaml.safe_load(text) or {})
            else:
                data.update(json.loads(text))
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)


def sides(size: str) -> tuple[int, int]:
    """`"832x480"` (a size field's text, as its pattern allows) as (width, height)."""
    w, _, h = size.partition("x")
    return int(w), int(h)


SMALL = Limits(
    max_width=128, max_height=128, max_steps=4, default_steps=2, max_n=2, max_frames=9,
    max_prompt_chars=200, max_sequence_length=32, video_fps=2, default_size="64x64", default_video_size="64x64",
    max_body_bytes=64 * 1024, max_reference_pixels=512 * 512,
)
"""The small profile tests and the demo use."""
