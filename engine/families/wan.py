"""The Wan family (Wan 2.1 text-to-video, `WanTransformer3DModel` + `WanPipeline`).

Owns: Wan's block list, its pipeline facts (VAE 8x spatial / 4x temporal, patch 1x2x2, frames
4k+1), what a request means for `WanPipeline` (CFG whenever guidance > 1, videos per prompt,
frames), how its output decodes (videos; an image request is the first frame of each), and the
tiny random Wan folder (`dlo make-tiny-model --family wan`).
Must never: import torch or diffusers at import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlo.engine.families.base import Decoded, Family, PipelineFacts

if TYPE_CHECKING:  # pragma: no cover
    from dlo.engine.serving.waves import Generation


class WanFamily(Family):
    name = "wan"
    class_names = ("WanTransformer3DModel",)
    block_lists = ("blocks",)
    pipeline_class = "WanPipeline"
    streamable_encoders = ("text_encoder",)  # UMT5-XXL

    def pipeline_facts(self, root: Path, index: dict, transformer: dict, vae: dict) -> PipelineFacts:
        if (index.get("transformer_2") or [None])[0] is not None:
            raise ValueError(f"{root}: two-transformer Wan 2.2 pipelines are not supported yet")
        spatial = int(vae.get("scale_factor_spatial") or 8)
        patch = transformer.get("patch_size", [1, 2, 2])
        return PipelineFacts("wan", self.pipeline_class, spatial * int(patch[1]),
                             int(vae.get("scale_factor_temporal") or 4), 5.0, transformer["_class_name"])

    def call_kwargs(self, gen: "Generation") -> dict[str, Any]:
        return {"num_frames": gen.frames, "num_videos_per_prompt": gen.n}

    def decode(self, out: Any, gen: "Generation") -> Decoded:
        import numpy as np

        videos = np.asarray(out.frames)  # (n, frames, H, W, 3)
        if gen.kind == "video":
            return Decoded(video=videos[0])
        return Decoded(images=tuple(v[0] for v in videos))

    def tiny_transformer_config(self, layers: int, dim: int, head_dim: int, in_channels: int,
                                text_dim: int) -> dict:
        # head_dim must split into (t, h, w) rope parts
        return {
            "_class_name": "WanTransformer3DModel",
            "patch_size": [1, 2, 2],
            "num_attention_heads": dim // head_dim,
            "attention_head_dim": head_dim,
            "in_channels": in_channels,
            "out_channels": in_channels,
            "text_dim": text_dim,
            "freq_dim": 32,
            "ffn_dim": 2 * dim,
            "num_layers": layers,
            "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads",
            "eps": 1e-6,
            "rope_max_seq_len": 256,
        }

    def write_tiny_components(self, out: Path, seed: int, dtype: str) -> dict:
        import torch
        from diffusers import AutoencoderKLWan
        from transformers import UMT5Config, UMT5EncoderModel

        from dlo.engine.families.tiny import T5_CONFIG, byte_level_tokenizer, flow_scheduler, save_random

        torch.manual_seed(seed)
        # Three spatial downsamples (8x) and two temporal ones (4x), as the real Wan VAE: the pipeline
        # derives its scale factors from this config.
        vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
        # The VAE is the one component kept float32: its decoder output becomes the image bytes.
        save_random(vae, out / "vae", "float32", seed + 1)
        enc = UMT5EncoderModel(UMT5Config(**T5_CONFIG))
        save_random(enc, out / "text_encoder", dtype, seed + 2)
        byte_level_tokenizer(512, bos=False).save_pretrained(out / "tokenizer")
        flow_scheduler(out, shift=5.0)
        return {
            "_class_name": "WanPipeline",
            "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
            "text_encoder": ["transformers", "UMT5EncoderModel"],
            "vae": ["diffusers", "AutoencoderKLWan"],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "transformer": ["diffusers", "WanTransformer3DModel"],
            "transformer_2": [None, None],
            "boundary_ratio": None,
            "expand_timesteps": False,
        }
