"""The Wan 2.1 image-to-video family (`WanImageToVideoPipeline`: UMT5 + CLIP image encoder + Wan transformer).

Owns: its pipeline facts (as Wan, plus `image_input`: every request brings the first frame, the
Videos API's `input_reference`), and the pipeline's `image` input: the uploaded bytes decoded with
PIL to RGB (the pipeline resizes it to the requested size); the warm-up, which has no upload, runs
on a mid-grey frame. Call count, decoding and blocks are Wan's.
Must never: import torch, diffusers or PIL at import time.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from dlo.engine.families.pipelines import PipelineFacts
from dlo.engine.families.wan import WanFamily
from dlo.engine.request import Generation


class WanI2VFamily(WanFamily):
    name = "wan-i2v"  # the transformer is Wan's (`WAN_BLOCKS`)
    pipeline_class = "WanImageToVideoPipeline"
    step_caches = True  # diffusers' cache hooks know its blocks; its pipeline names each call's cache context
    decode_beside_warmup = False  # its call encodes the input image with the VAE the decode would use
    cfg_pairs = True  # its calls add the image's embeddings, the same object to both (tests/engine/test_cfg_pairs.py)

    def matches(self, index: dict) -> bool:
        return (index.get("_class_name") == self.pipeline_class
                and (index.get("transformer_2") or [None])[0] is None)

    def pipeline_facts(self, root: Path, index: dict, transformer: dict, vae: dict) -> PipelineFacts:
        base = WanFamily.pipeline_facts(self, root, index, transformer, vae)
        return PipelineFacts(self.name, self.pipeline_class, base.size_multiple, base.temporal_factor,
                             base.default_guidance, base.transformer_class, image_input=True)

    def call_inputs(self, gen: Generation) -> dict[str, Any]:
        from PIL import Image

        if gen.image is None:  # the warm-up: no upload, a mid-grey first frame of the requested size
            return {"image": Image.new("RGB", (gen.width, gen.height), (128, 128, 128))}
        with Image.open(io.BytesIO(gen.image)) as img:
            return {"image": img.convert("RGB")}
