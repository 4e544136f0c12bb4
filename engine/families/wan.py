"""The Wan family (Wan 2.1 text-to-video, `WanTransformer3DModel` + `WanPipeline`).

Owns: Wan's block list, its pipeline facts (VAE 8x spatial / 4x temporal, patch 1x2x2, frames
4k+1), what a request means for `WanPipeline` (CFG whenever guidance > 1, videos per prompt,
frames) and how its output decodes (videos; an image request is the first frame of each), and the
call's decode alone for the warm-up (`warm_decode`). The tiny random Wan folder is `dlo.engine.families.tiny_writers.WanTiny`.
Must never: import torch or diffusers at import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlo.engine.families.base import BlockFamily
from dlo.engine.families.pipelines import Decoded, PipelineFacts, PipelineFamily
from dlo.engine.request import Generation

# Wan 2.1 and 2.2 transformers (text-to-video, image-to-video, both experts): one block list.
WAN_BLOCKS = BlockFamily("wan", ("WanTransformer3DModel",), ("blocks",))


class WanFamily(PipelineFamily):
    name = "wan"
    blocks = WAN_BLOCKS
    pipeline_class = "WanPipeline"
    step_caches = True  # diffusers' cache hooks know its blocks; its pipeline names each call's cache context
    streamable_encoders = ("text_encoder",)  # UMT5-XXL
    decode_beside_warmup = True
    cfg_pairs = True  # WanPipeline: cond, then uncond with `negative_prompt_embeds` (tests/engine/test_cfg_pairs.py)

    def pipeline_facts(self, root: Path, index: dict, transformer: dict, vae: dict) -> PipelineFacts:
        if (index.get("transformer_2") or [None])[0] is not None:
            raise ValueError(f"{root}: two-transformer Wan 2.2 pipelines are not supported yet")
        spatial = int(vae.get("scale_factor_spatial") or 8)
        patch = transformer.get("patch_size", [1, 2, 2])
        return PipelineFacts("wan", self.pipeline_class, spatial * int(patch[1]),
                             int(vae.get("scale_factor_temporal") or 4), 5.0, transformer["_class_name"])

    def paired_lane_bytes(self, transformer: dict) -> tuple[int, int]:
        # WanTransformer3DModel's forward waiting in a block's forward hook: the block's input and output
        # hidden states (dim, bfloat16) and the rotary tables (cos and sin of head_dim, at most float64)
        # a latent token; the projected text states (dim, bfloat16; the blocks do not replace them) a
        # text token (its time projections: a few dim-wide rows, left out)
        head_dim = int(transformer["attention_head_dim"])
        dim = int(transformer["num_attention_heads"]) * head_dim
        return (2 * dim * 2 + 2 * head_dim * 8, dim * 2)

    def call_kwargs(self, gen: Generation) -> dict[str, Any]:
        return {"num_frames": gen.frames, "num_videos_per_prompt": gen.n}

    def decode(self, out: Any, gen: Generation) -> Decoded:
        import numpy as np

        videos = np.asarray(out.frames)  # (n, frames, H, W, 3)
        if gen.kind == "video":
            return Decoded(video=videos[0])
        return Decoded(images=tuple(v[0] for v in videos))

    def warm_decode(self, pipe: Any, gen: Generation) -> Any:
        # WanPipeline's decode: the latents in the VAE's dtype, de-normalised (the values change, the
        # shape and dtype the kernels are chosen by do not), `vae.decode`, `video_processor.postprocess_video`
        from types import SimpleNamespace

        import torch

        vae = pipe.vae
        frames = (max(1, gen.frames) - 1) // pipe.vae_scale_factor_temporal + 1
        side = pipe.vae_scale_factor_spatial
        z = torch.zeros(gen.n, vae.config.z_dim, frames, gen.height // side, gen.width // side,
                        dtype=vae.dtype, device=next(vae.parameters()).device)
        video = vae.decode(z, return_dict=False)[0]
        return SimpleNamespace(frames=pipe.video_processor.postprocess_video(video, output_type="np"))
