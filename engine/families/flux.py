"""The Flux family (Flux.1 text-to-image, `FluxTransformer2DModel` + `FluxPipeline`).

Owns: Flux's two block lists (double-stream, then single-stream), its pipeline facts (VAE scale x
2x2 latent packing, images only), what a request means for `FluxPipeline` (true CFG only with a
negative prompt and guidance > 1, images per prompt), how its output decodes, and the tiny random
Flux folder (`dlo make-tiny-model --family flux`).
Must never: import torch or diffusers at import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from dlo.engine.families.base import Decoded, Family, PipelineFacts

if TYPE_CHECKING:  # pragma: no cover
    from dlo.engine.serving.waves import Generation


class FluxFamily(Family):
    name = "flux"
    class_names = ("FluxTransformer2DModel",)
    block_lists = ("transformer_blocks", "single_transformer_blocks")
    pipeline_class = "FluxPipeline"
    streamable_encoders = ("text_encoder_2",)  # T5-XXL (CLIP-L, 0.25 GB, stays whole)

    def pipeline_facts(self, root: Path, index: dict, transformer: dict, vae: dict) -> PipelineFacts:
        scale = 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1)
        # latents are packed 2x2 before the transformer's own patch embedding
        return PipelineFacts("flux", self.pipeline_class, scale * 2, 0, 3.5, transformer["_class_name"])

    def uses_cfg(self, gen: "Generation") -> bool:
        return gen.negative_prompt is not None and gen.guidance_scale > 1.0  # Flux true CFG

    def call_kwargs(self, gen: "Generation") -> dict[str, Any]:
        return {"num_images_per_prompt": gen.n, "true_cfg_scale": gen.guidance_scale if self.uses_cfg(gen) else 1.0}

    def decode(self, out: Any, gen: "Generation") -> Decoded:
        import numpy as np

        return Decoded(images=tuple(np.asarray(out.images)))

    def tiny_transformer_config(self, layers: int, dim: int, head_dim: int, in_channels: int,
                                text_dim: int) -> dict:
        # Flux runs `layers` double-stream blocks then `layers + 1` single-stream blocks: two block
        # kinds of different sizes and an odd total, which the offload tests rely on. The rope axes
        # must sum to head_dim.
        return {
            "_class_name": "FluxTransformer2DModel",
            "patch_size": 1,
            "in_channels": in_channels * 4,
            "num_layers": layers,
            "num_single_layers": layers + 1,
            "attention_head_dim": head_dim,
            "num_attention_heads": dim // head_dim,
            "joint_attention_dim": text_dim,
            "pooled_projection_dim": text_dim,
            "guidance_embeds": False,
            "axes_dims_rope": [4, 6, 6],
        }

    def write_tiny_components(self, out: Path, seed: int, dtype: str) -> dict:
        import torch
        from diffusers import AutoencoderKL
        from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

        from dlo.engine.families.tiny import (
            CLIP_MAX_LENGTH,
            T5_CONFIG,
            TEXT_DIM,
            VOCAB_SIZE,
            byte_level_tokenizer,
            flow_scheduler,
            save_random,
        )

        torch.manual_seed(seed)
        # 16 latent channels: the transformer's in_channels 64 are 16 channels packed 2x2.
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=16,
            down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
            block_out_channels=[8, 8, 16, 16], layers_per_block=1, norm_num_groups=4,
            scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
        )
        save_random(vae, out / "vae", "float32", seed + 1)
        clip = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=VOCAB_SIZE, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=CLIP_MAX_LENGTH, projection_dim=TEXT_DIM,
                pad_token_id=0, bos_token_id=3, eos_token_id=1,
            )
        )
        save_random(clip, out / "text_encoder", dtype, seed + 2)
        t5 = T5EncoderModel(T5Config(**T5_CONFIG))
        save_random(t5, out / "text_encoder_2", dtype, seed + 3)
        byte_level_tokenizer(CLIP_MAX_LENGTH, bos=True).save_pretrained(out / "tokenizer")
        byte_level_tokenizer(512, bos=False).save_pretrained(out / "tokenizer_2")
        flow_scheduler(
            out, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096,
        )
        return {
            "_class_name": "FluxPipeline",
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "vae": ["diffusers", "AutoencoderKL"],
            "text_encoder": ["transformers", "CLIPTextModel"],
            "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
            "text_encoder_2": ["transformers", "T5EncoderModel"],
            "tokenizer_2": ["transformers", "PreTrainedTokenizerFast"],
            "transformer": ["diffusers", "FluxTransformer2DModel"],
            "image_encoder": [None, None],
            "feature_extractor": [None, None],
        }
