"""Named pipeline presets: the published configs of real models, and tiny ones of the same classes.

`dlo make-random-model OUT --preset NAME` (`dlo.engine.random_model`) writes a diffusers-format
folder from one of these. A preset lists every component of the pipeline (folder, library, class,
config, stored dtype, file sharding), its tokenizers (generated: the real files cannot be
downloaded), its scheduler and the extra entries of `model_index.json`.

The full-size values are the published `config.json` files of the named repositories (each preset
names its source); class defaults are written out where the published file relies on them, so a
reader sees every dimension. `tests/engine/test_presets.py` instantiates every class from every
config on the meta device, so a field name diffusers or transformers does not know fails CI, and
checks the transformer and text-encoder parameter counts against the published ones. Scheduler
configs, VAE latent statistics and shard sizes cannot be checked offline the same way: they are
written from the published files as recorded here, and a difference found against the real files
is a bug to fix in this module.
Stored dtypes: transformers and text encoders bfloat16 (the dtype they are served in; diffusers'
`_keep_in_fp32_modules` stay float32 as its own `save_pretrained` leaves them), VAEs float32. File
sharding: the shard size per component gives the published file count for the bf16 weights
(approximately; exact sizes per file are not reproduced).

Owns: `PRESETS` (every preset by name: the full-size and tiny ones here, the Cosmos3 and MiniMax-H3
ones of `dlo.engine.presets_omni`) and `preset(name, layers=None)`; what a preset is (`Preset`,
`Component`, `TokenizerSpec`) and the values both modules share are `dlo.engine.presets_base`'s.
Must never: import torch, diffusers or transformers (plain data; `random_model.py` builds from it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dlo.engine.presets_base import GB, QWEN_SPECIALS, WAN_UNIPC, Component, Preset, TokenizerSpec
from dlo.engine.presets_omni import omni_presets


# ---- shared published configs -------------------------------------------------------------------
# Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json (also both experts of Wan2.2-T2V-A14B).
WAN_14B = {
    "patch_size": [1, 2, 2], "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
    "added_kv_proj_dim": None, "rope_max_seq_len": 1024,
}
# Wan-AI/Wan2.1-I2V-14B-480P-Diffusers transformer/config.json: 16 noise + 20 condition channels,
# CLIP image tokens through added K/V projections.
WAN_I2V_14B = {**WAN_14B, "in_channels": 36, "image_dim": 1280, "added_kv_proj_dim": 5120}
# google/umt5-xxl config.json (Wan's text_encoder: the encoder stack only).
UMT5_XXL = {
    "vocab_size": 256384, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_decoder_layers": 24,
    "num_heads": 64, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
    "dropout_rate": 0.1, "layer_norm_epsilon": 1e-6, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
    "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0,
}
# Wan2.1 VAE (vae/config.json of the Wan Diffusers repositories; equal to AutoencoderKLWan's defaults).
WAN_VAE = {
    "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
    "temperal_downsample": [False, True, True], "dropout": 0.0,
    "latents_mean": [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                     0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    "latents_std": [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                    3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160],
}
# openai/clip-vit-large-patch14 text model (Flux.1's text_encoder).
CLIP_L_TEXT = {
    "vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "projection_dim": 768,
    "num_hidden_layers": 12, "num_attention_heads": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu",
    "layer_norm_eps": 1e-5, "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2,
}
# google/t5-v1_1-xxl encoder (Flux.1's text_encoder_2).
T5_XXL = {
    "vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_decoder_layers": 24,
    "num_heads": 64, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
    "dropout_rate": 0.1, "layer_norm_epsilon": 1e-6, "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
    "pad_token_id": 0, "eos_token_id": 1,
}
# laion/CLIP-ViT-H-14 vision tower (image_encoder/config.json of Wan2.1-I2V-14B-480P-Diffusers).
CLIP_H_VISION = {
    "hidden_size": 1280, "intermediate_size": 5120, "projection_dim": 1024, "num_hidden_layers": 32,
    "num_attention_heads": 16, "num_channels": 3, "image_size": 224, "patch_size": 14, "hidden_act": "gelu",
    "layer_norm_eps": 1e-5,
}
CLIP_IMAGE_PROCESSOR = {
    "crop_size": {"height": 224, "width": 224}, "do_center_crop": True, "do_convert_rgb": True,
    "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3, "rescale_factor": 1 / 255,
    "size": {"shortest_edge": 224},
}

UMT5_TOKENIZER = TokenizerSpec("tokenizer", 256384, 512, {"<pad>": 0, "</s>": 1, "<unk>": 2}, pad="<pad>",
                               eos="</s>", unk="<unk>")
T5_TOKENIZER = TokenizerSpec("tokenizer_2", 32128, 512, {"<pad>": 0, "</s>": 1, "<unk>": 2}, pad="<pad>",
                             eos="</s>", unk="<unk>")
CLIP_TOKENIZER = TokenizerSpec("tokenizer", 49408, 77, {"<|startoftext|>": 49406, "<|endoftext|>": 49407},
                               pad="<|endoftext|>", eos="<|endoftext|>", bos="<|startoftext|>",
                               unk="<|endoftext|>", prepend_bos=True)
QWEN_TOKENIZER = TokenizerSpec("tokenizer", 152064, 131072, QWEN_SPECIALS, pad="<|endoftext|>",
                               eos="<|im_end|>", append_eos=False)

WAN_INDEX = {"transformer_2": [None, None], "boundary_ratio": None, "expand_timesteps": False}


def _wan_common(text_layers_key: tuple[str, ...] = ("num_layers",)) -> list[Component]:
    return [
        Component("text_encoder", "transformers", "UMT5EncoderModel", UMT5_XXL, max_shard_bytes=5 * GB // 2,
                  layer_keys=text_layers_key),
        Component("vae", "diffusers", "AutoencoderKLWan", WAN_VAE, dtype="float32"),
    ]


def _full() -> dict[str, Preset]:
    return {p.name: p for p in (*_full_wan(), *_full_image())}


def _full_wan() -> list[Preset]:
    wan_sched = ("UniPCMultistepScheduler", WAN_UNIPC)
    return [
        Preset(
            "wan2.1-t2v-14b", "Wan-AI/Wan2.1-T2V-14B-Diffusers", "WanPipeline",
            (Component("transformer", "diffusers", "WanTransformer3DModel", WAN_14B, max_shard_bytes=5 * GB,
                       layer_keys=("num_layers",)), *_wan_common()),
            (UMT5_TOKENIZER,), wan_sched, WAN_INDEX,
        ),
        Preset(
            "wan2.1-i2v-14b", "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "WanImageToVideoPipeline",
            (Component("transformer", "diffusers", "WanTransformer3DModel", WAN_I2V_14B, max_shard_bytes=5 * GB,
                       layer_keys=("num_layers",)), *_wan_common(),
             Component("image_encoder", "transformers", "CLIPVisionModel", CLIP_H_VISION)),
            (UMT5_TOKENIZER,), wan_sched, WAN_INDEX, image_processor=CLIP_IMAGE_PROCESSOR,
        ),
        Preset(
            # Two experts of the 14B shape: `transformer` runs the high-noise steps (t >= 0.875 * 1000),
            # `transformer_2` the low-noise ones (model_index.json boundary_ratio, read by WanPipeline).
            "wan2.2-t2v-a14b", "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "WanPipeline",
            (Component("transformer", "diffusers", "WanTransformer3DModel", WAN_14B, max_shard_bytes=5 * GB,
                       layer_keys=("num_layers",)),
             Component("transformer_2", "diffusers", "WanTransformer3DModel", WAN_14B, max_shard_bytes=5 * GB,
                       layer_keys=("num_layers",)), *_wan_common()),
            (UMT5_TOKENIZER,), ("UniPCMultistepScheduler", {**WAN_UNIPC, "flow_shift": 12.0}),
            {"transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 0.875,
             "expand_timesteps": False},
        ),
    ]


def _full_image() -> list[Preset]:
    return [
        Preset(
            "flux.1-dev", "black-forest-labs/FLUX.1-dev", "FluxPipeline",
            (Component("transformer", "diffusers", "FluxTransformer2DModel", {
                "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
                "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
                "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": [16, 56, 56],
            }, max_shard_bytes=10 * GB, layer_keys=("num_layers", "num_single_layers")),
             Component("text_encoder", "transformers", "CLIPTextModel", CLIP_L_TEXT),
             Component("text_encoder_2", "transformers", "T5EncoderModel", T5_XXL, max_shard_bytes=5 * GB,
                       layer_keys=("num_layers",)),
             Component("vae", "diffusers", "AutoencoderKL", {
                 "in_channels": 3, "out_channels": 3, "latent_channels": 16, "act_fn": "silu",
                 "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
                 "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "norm_num_groups": 32,
                 "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False,
                 "use_post_quant_conv": False, "mid_block_add_attention": True,
             }, dtype="float32")),
            (CLIP_TOKENIZER, T5_TOKENIZER),
            ("FlowMatchEulerDiscreteScheduler", {
                "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096,
            }),
            {"image_encoder": [None, None], "feature_extractor": [None, None]},
        ),
        Preset(
            "qwen-image", "Qwen/Qwen-Image", "QwenImagePipeline",
            (Component("transformer", "diffusers", "QwenImageTransformer2DModel", {
                "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
                "num_attention_heads": 24, "joint_attention_dim": 3584, "guidance_embeds": False,
                "axes_dims_rope": [16, 56, 56],
            }, max_shard_bytes=5 * GB, layer_keys=("num_layers",)),
             # Qwen/Qwen-Image text_encoder/config.json (Qwen2.5-VL-7B-Instruct), flat as on the hub.
             Component("text_encoder", "transformers", "Qwen2_5_VLForConditionalGeneration", {
                 "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                 "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_act": "silu",
                 "max_position_embeddings": 128000, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                 "rope_scaling": {"type": "mrope", "rope_type": "default", "mrope_section": [16, 24, 24]},
                 "attention_dropout": 0.0, "tie_word_embeddings": False, "bos_token_id": 151643,
                 "eos_token_id": 151645, "image_token_id": 151655, "video_token_id": 151656,
                 "vision_start_token_id": 151652, "vision_end_token_id": 151653,
                 "vision_config": {
                     "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                     "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                     "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "in_chans": 3,
                     "hidden_act": "silu", "tokens_per_second": 2,
                 },
             }, max_shard_bytes=5 * GB, layer_keys=("num_hidden_layers",)),
             Component("vae", "diffusers", "AutoencoderKLQwenImage", {
                 "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
                 "temperal_downsample": [False, True, True], "dropout": 0.0,
             }, dtype="float32")),
            (QWEN_TOKENIZER,),
            ("FlowMatchEulerDiscreteScheduler", {
                "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
                "time_shift_type": "exponential",
            }),
        ),
    ]


# ---- tiny presets: the same classes and component layout, small dimensions (CI) -----------------
TINY_VOCAB = 260  # the byte-level tokenizer: 256 bytes + 4 specials
TINY_TEXT = 32
TINY_T5 = {"vocab_size": TINY_VOCAB, "d_model": TINY_TEXT, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4,
           "relative_attention_num_buckets": 8, "relative_attention_max_distance": 32, "pad_token_id": 0,
           "eos_token_id": 1}


def _tiny_tok(name: str, max_length: int, **kw: Any) -> TokenizerSpec:
    specials = kw.pop("specials", {"<pad>": 0, "</s>": 1, "<unk>": 2, "<s>": 3})
    return TokenizerSpec(name, kw.pop("vocab_size", TINY_VOCAB), max_length, specials, pad=kw.pop("pad", "<pad>"),
                         eos=kw.pop("eos", "</s>"), unk=kw.pop("unk", "<unk>"), bos=kw.pop("bos", "<s>"), **kw)


def _tiny() -> dict[str, Preset]:
    return {p.name: p for p in (*_tiny_wan(), *_tiny_image())}


def _tiny_wan() -> list[Preset]:
    wan_t = {"patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 16,
             "out_channels": 16, "text_dim": TINY_TEXT, "freq_dim": 32, "ffn_dim": 64, "num_layers": 3,
             "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 256}
    wan_vae = {"base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1}
    wan_common = [Component("text_encoder", "transformers", "UMT5EncoderModel", TINY_T5, dtype="float32",
                            layer_keys=("num_layers",)),
                  Component("vae", "diffusers", "AutoencoderKLWan", wan_vae, dtype="float32")]
    flow = ("FlowMatchEulerDiscreteScheduler", {"shift": 5.0})
    tok = (_tiny_tok("tokenizer", 512, bos=None),)
    vision = {"hidden_size": 32, "intermediate_size": 64, "projection_dim": 32, "num_hidden_layers": 2,
              "num_attention_heads": 4, "image_size": 32, "patch_size": 8}
    return [
        Preset("tiny-wan2.1-t2v", "tiny", "WanPipeline",
               (Component("transformer", "diffusers", "WanTransformer3DModel", wan_t, "float32",
                          layer_keys=("num_layers",)), *wan_common), tok, flow, WAN_INDEX),
        Preset("tiny-wan2.1-i2v", "tiny", "WanImageToVideoPipeline",
               (Component("transformer", "diffusers", "WanTransformer3DModel",
                          {**wan_t, "in_channels": 36, "image_dim": 32, "added_kv_proj_dim": 32}, "float32",
                          layer_keys=("num_layers",)), *wan_common,
                Component("image_encoder", "transformers", "CLIPVisionModel", vision, "float32")),
               tok, flow, WAN_INDEX,
               image_processor={**CLIP_IMAGE_PROCESSOR, "crop_size": {"height": 32, "width": 32},
                                "size": {"shortest_edge": 32}}),
        Preset("tiny-wan2.2-t2v-a14b", "tiny", "WanPipeline",
               (Component("transformer", "diffusers", "WanTransformer3DModel", wan_t, "float32",
                          layer_keys=("num_layers",)),
                Component("transformer_2", "diffusers", "WanTransformer3DModel", {**wan_t, "num_layers": 2},
                          "float32", layer_keys=("num_layers",)), *wan_common),
               tok, flow, {"transformer_2": ["diffusers", "WanTransformer3DModel"], "boundary_ratio": 0.875,
                           "expand_timesteps": False}),
    ]


def _tiny_image() -> list[Preset]:
    qwen_text = {
        "vocab_size": 512, "hidden_size": TINY_TEXT, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
        "rope_scaling": {"type": "mrope", "rope_type": "default", "mrope_section": [1, 1, 2]},
        "bos_token_id": 500, "eos_token_id": 502, "image_token_id": 507, "video_token_id": 508,
        "vision_start_token_id": 505, "vision_end_token_id": 506,
        "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                          "out_hidden_size": TINY_TEXT, "fullatt_block_indexes": [0], "window_size": 16,
                          "patch_size": 4},
    }
    qwen_specials = {"<|endoftext|>": 500, "<|im_start|>": 501, "<|im_end|>": 502, "<|vision_start|>": 505,
                     "<|vision_end|>": 506, "<|image_pad|>": 507, "<|video_pad|>": 508}
    return [
        Preset("tiny-flux.1-dev", "tiny", "FluxPipeline",
               (Component("transformer", "diffusers", "FluxTransformer2DModel", {
                   "patch_size": 1, "in_channels": 64, "num_layers": 2, "num_single_layers": 3,
                   "attention_head_dim": 16, "num_attention_heads": 2, "joint_attention_dim": TINY_TEXT,
                   "pooled_projection_dim": TINY_TEXT, "guidance_embeds": True, "axes_dims_rope": [4, 6, 6],
               }, "float32", layer_keys=("num_layers", "num_single_layers")),
                Component("text_encoder", "transformers", "CLIPTextModel", {
                    "vocab_size": TINY_VOCAB, "hidden_size": TINY_TEXT, "intermediate_size": 64,
                    "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 77,
                    "projection_dim": TINY_TEXT, "pad_token_id": 0, "bos_token_id": 3, "eos_token_id": 1,
                }, "float32"),
                Component("text_encoder_2", "transformers", "T5EncoderModel", TINY_T5, "float32",
                          layer_keys=("num_layers",)),
                Component("vae", "diffusers", "AutoencoderKL", {
                    "in_channels": 3, "out_channels": 3, "latent_channels": 16,
                    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
                    "block_out_channels": [8, 8, 16, 16], "layers_per_block": 1, "norm_num_groups": 4,
                    "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_quant_conv": False,
                    "use_post_quant_conv": False,
                }, "float32")),
               (_tiny_tok("tokenizer", 77, prepend_bos=True), _tiny_tok("tokenizer_2", 512, bos=None)),
               ("FlowMatchEulerDiscreteScheduler", {
                   "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
                   "base_image_seq_len": 256, "max_image_seq_len": 4096}),
               {"image_encoder": [None, None], "feature_extractor": [None, None]}),
        Preset("tiny-qwen-image", "tiny", "QwenImagePipeline",
               (Component("transformer", "diffusers", "QwenImageTransformer2DModel", {
                   "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 3, "attention_head_dim": 16,
                   "num_attention_heads": 2, "joint_attention_dim": TINY_TEXT, "guidance_embeds": False,
                   "axes_dims_rope": [4, 6, 6]}, "float32", layer_keys=("num_layers",)),
                Component("text_encoder", "transformers", "Qwen2_5_VLForConditionalGeneration", qwen_text,
                          "float32", layer_keys=("num_hidden_layers",)),
                Component("vae", "diffusers", "AutoencoderKLQwenImage", {
                    "base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1}, "float32")),
               (_tiny_tok("tokenizer", 1024, vocab_size=512, specials={"<pad>": 0, **qwen_specials},
                          pad="<|endoftext|>", eos="<|im_end|>", bos=None, unk=None, append_eos=False),),
               ("FlowMatchEulerDiscreteScheduler", {
                   "shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 0.9,
                   "base_image_seq_len": 256, "max_image_seq_len": 8192})),
    ]


PRESETS: dict[str, Preset] = {**_full(), **_tiny(), **omni_presets()}


def _with_layers(c: Component, layers: int) -> Component:
    if not c.layer_keys:
        return c
    cfg = dict(c.config)
    if c.layer_keys == ("num_layers", "num_single_layers"):  # Flux: double then single blocks, 1:2 as published
        cfg["num_layers"] = min(cfg["num_layers"], layers)
        cfg["num_single_layers"] = min(cfg["num_single_layers"], 2 * layers)
    else:
        for key in c.layer_keys:
            outer, _, inner = key.rpartition(".")
            if outer:
                cfg[outer] = dict(cfg[outer])
            sub = cfg[outer] if outer else cfg
            sub[inner] = min(sub[inner], max(layers, c.min_layers))
    if c.class_name in ("UMT5EncoderModel", "T5EncoderModel"):
        cfg["num_decoder_layers"] = cfg.get("num_layers")
    return dataclasses.replace(c, config=cfg)


def preset(name: str, layers: int | None = None) -> Preset:
    """The named preset; `layers` caps the transformer block count(s) and the large text encoder's
    layer count (UMT5/T5 blocks, Qwen2.5-VL / Qwen3-VL decoder layers, never below a component's
    `min_layers`; CLIP and vision towers stay whole)."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    p = PRESETS[name]
    if layers is None:
        return p
    if layers < 1:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    return dataclasses.replace(p, components=tuple(_with_layers(c, layers) for c in p.components))
