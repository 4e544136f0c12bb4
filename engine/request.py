"""The request type: one generation, validated, as it travels from rank 0's HTTP side to a rank.

Owns: `Generation`, the plain data a family adapter reads to plan and run a request (its call plan,
keyword arguments, inputs and decoding) and that the control plane pickles to the ranks.
Must never: import torch or anything of `dlo.serving` (the family adapters import it: the
core does not reach up into serving), or know how requests are grouped into waves (the
compatibility key and the queue are `dlo.serving.waves`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from dlo.engine.cache_presets import CacheSpec


@dataclass(frozen=True)
class Generation:
    """One request, validated and with every default resolved."""

    kind: Literal["image", "video"]
    prompt: str
    seed: int
    width: int
    height: int
    steps: int
    guidance_scale: float
    n: int = 1
    frames: int = 1
    fps: int = 0
    negative_prompt: str | None = None
    lora_id: str | None = None
    lora_scale: float = 1.0
    # the step cache it runs with (`dlo.engine.cache_presets`; the server's default already resolved),
    # None: none. Not part of the wave's compatibility key: each rank enables its own request's cache
    cache: CacheSpec | None = None
    # some request of its wave has a step cache: in allgather every rank of the wave, this one too,
    # plans each transformer call's gathers with the others' (`dlo.engine.skip_plan`); set by the wave
    wave_caches: bool = False
    extras: dict[str, Any] = field(default_factory=dict)  # pipeline extras, JSON values
    # image-to-video: the uploaded first frame (encoded bytes, decoded on the rank); not part of the
    # wave's compatibility key: every image of a wave is resized to the wave's size
    image: bytes | None = field(default=None, repr=False)
    # the start's warm-up request, every rank's, its output discarded (`dlo.serving.warm_run`)
    warmup: bool = False
