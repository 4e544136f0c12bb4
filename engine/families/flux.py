"""The Flux family (Flux.1 text-to-image, `FluxTransformer2DModel` + `FluxPipeline`).

Owns: Flux's two block lists (double-stream, then single-stream), its pipeline facts (VAE scale x
2x2 latent packing, images only), what a request means for `FluxPipeline` (true CFG only with a
negative prompt and guidance > 1, images per prompt) and how its output decodes. The tiny random
Flux folder is `dlo.engine.families.tiny_writers.FluxTiny`.
Must never: import torch or diffusers at import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlo.engine.families.base import BlockFamily
from dlo.engine.families.pipelines import Decoded, PipelineFacts, PipelineFamily
from dlo.engine.request import Generation

# Double-stream blocks, then single-stream ones: the order forward runs them.
FLUX_BLOCKS = BlockFamily("flux", ("FluxTransformer2DModel",), ("transformer_blocks", "single_transformer_blocks"))


class FluxFamily(PipelineFamily):
    name = "flux"
    blocks = FLUX_BLOCKS
    pipeline_class = "FluxPipeline"
    step_caches = True  # diffusers' cache hooks know its blocks; its pipeline names each call's cache context
    two_streams = True  # its blocks return the text stream beside the image's
    streamable_encoders = ("text_encoder_2",)  # T5-XXL (CLIP-L, 0.25 GB, stays whole)

    def pipeline_facts(self, root: Path, index: dict, transformer: dict, vae: dict) -> PipelineFacts:
        scale = 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1)
        # latents are packed 2x2 before the transformer's own patch embedding
        return PipelineFacts("flux", self.pipeline_class, scale * 2, 0, 3.5, transformer["_class_name"])

    def uses_cfg(self, gen: Generation) -> bool:
        return gen.negative_prompt is not None and gen.guidance_scale > 1.0  # Flux true CFG

    def call_kwargs(self, gen: Generation) -> dict[str, Any]:
        return {"num_images_per_prompt": gen.n, "true_cfg_scale": gen.guidance_scale if self.uses_cfg(gen) else 1.0}

    def decode(self, out: Any, gen: Generation) -> Decoded:
        import numpy as np

        return Decoded(images=tuple(np.asarray(out.images)))
