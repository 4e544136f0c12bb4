"""The Qwen-Image family (`QwenImageTransformer2DModel` + `QwenImagePipeline`, Qwen2.5-VL text encoder).

Owns: its block list (`transformer_blocks`), its pipeline facts (VAE 8x, latents packed 2x2, images
only, true CFG scale 4 by default), what a request means for `QwenImagePipeline` (true CFG, a
separate unconditional transformer call, only with a negative prompt and a scale > 1; no
guidance-distillation input), and how its output decodes.
Must never: import torch or diffusers at import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlo.engine.families.base import BlockFamily
from dlo.engine.families.pipelines import Decoded, PipelineFacts, PipelineFamily
from dlo.engine.request import Generation

QWEN_IMAGE_BLOCKS = BlockFamily("qwen-image", ("QwenImageTransformer2DModel",), ("transformer_blocks",))


class QwenImageFamily(PipelineFamily):
    name = "qwen-image"
    blocks = QWEN_IMAGE_BLOCKS
    pipeline_class = "QwenImagePipeline"
    step_caches = True  # diffusers' cache hooks know its blocks; its pipeline names each call's cache context
    two_streams = True  # its blocks return the text stream beside the image's
    streamable_encoders = ("text_encoder",)  # Qwen2.5-VL-7B's language model layers
    # QwenImagePipeline: cond, then uncond with the negative embeddings and mask; its `timestep / 1000`
    # is a new tensor a call, checked by value (tests/engine/test_cfg_pairs.py)
    cfg_pairs = True

    def pipeline_facts(self, root: Path, index: dict, transformer: dict, vae: dict) -> PipelineFacts:
        scale = 2 ** len(vae.get("temperal_downsample", [False, True, True]))
        return PipelineFacts(self.name, self.pipeline_class, scale * 2, 0, 4.0, transformer["_class_name"])

    def paired_lane_bytes(self, transformer: dict) -> tuple[int, int]:
        # QwenImageTransformer2DModel waiting in a block's forward hook: each stream's input and output
        # states (dim, bfloat16: the blocks replace both streams) and rotary tables (head_dim / 2
        # complex values, counted at 16 bytes) a token of each stream
        head_dim = int(transformer["attention_head_dim"])
        per = 2 * int(transformer["num_attention_heads"]) * head_dim * 2 + head_dim * 8
        return (per, per)

    def uses_cfg(self, gen: Generation) -> bool:
        return gen.negative_prompt is not None and gen.guidance_scale > 1.0

    def call_kwargs(self, gen: Generation) -> dict[str, Any]:
        return {"num_images_per_prompt": gen.n, "true_cfg_scale": gen.guidance_scale if self.uses_cfg(gen) else 1.0,
                "guidance_scale": None}

    def decode(self, out: Any, gen: Generation) -> Decoded:
        import numpy as np

        return Decoded(images=tuple(np.asarray(out.images)))
