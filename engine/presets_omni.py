"""Presets of the audio-video ("omni") models the published system measured: Cosmos3-Nano, Cosmos3-Super
and MiniMax-H3, and their tiny twins for CI.

Where each number comes from is said next to it. RECONSTRUCTED marks a value that no published
file reachable from here shows: it is then the closest documented configuration (and the preset's
parameter count still matches the published one within 4 %: `tests/engine/test_presets.py`).
The published sizes are whole repositories, not transformers: Cosmos3-Nano "17B, 33 GB, 72 blocks"
is its transformer (15.17 B parameters, 36 layers of two pathways each, which vLLM-Omni streams as
36 + 36 blocks) plus VAE, sound tokenizer and vision encoder, in GiB; Super "64B, 124 GB, 128
blocks" likewise (64.02 B, 64 layers). MiniMax-H3's transformer is 33.12 B (61.7 GiB), its
Qwen3-VL-32B text encoder 33.36 B.
Owns: `omni_presets()` (the five presets, keyed by name).
Must never: import torch, diffusers or transformers (plain data, as `dlo.engine.presets`), or import
`dlo.engine.presets` (the registry gathers these; the shared types are `dlo.engine.presets_base`'s).
"""

from __future__ import annotations

from dlo.engine.presets_base import GB, QWEN_SPECIALS, WAN_UNIPC, Component, Preset, TokenizerSpec

GIB = 1 << 30

# ---- Cosmos3 ------------------------------------------------------------------------------------
# nvidia/Cosmos3-Nano transformer/config.json, quoted verbatim in two indexed repositories (a
# Cosmos3-Omni generator test: "Verbatim nvidia/Cosmos3-Nano transformer/config.json";
# tmquan/nanoCosmos nanocosmos/models/cosmos_3_nano/variants.py). Its keys that are no argument of
# Cosmos3OmniTransformer (model_type, use_moe, max_position_embeddings, ...: diffusers ignores them)
# are left out.
COSMOS3_NANO = {
    "action_dim": 64, "action_gen": True, "attention_bias": False, "attention_dropout": 0.0, "base_fps": 24,
    "enable_fps_modulation": True, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 12288, "latent_channel": 48, "latent_patch_size": 2, "num_attention_heads": 32,
    "num_embodiment_domains": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "patch_latent_dim": 192,
    "qk_norm_for_text": True, "rms_norm_eps": 1e-6,
    "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
    "rope_theta": 5000000.0, "sound_dim": 64, "sound_gen": True, "sound_latent_fps": 25.0, "timestep_scale": 0.001,
    "unified_3d_mrope_reset_spatial_ids": True, "unified_3d_mrope_temporal_modality_margin": 15000,
    "vocab_size": 151936,
}
# Cosmos3-Super: hidden 5120, 64 layers, 64 / 8 heads, head_dim 128, MLP 25600 (latents 48, patch 2)
# from tmquan/nanoCosmos cosmos_3_super/variants.py ("mirrored verbatim from the published HF
# config"; Qwen3-VL-32B's text shape; diffusers' docs: "CP degree must divide ... 64 for Super", TP
# "the KV heads (8)"). RECONSTRUCTED, copied from Nano: the sound and action fields, vocabulary,
# rope, patch_latent_dim, fps and mRoPE-margin fields (diffusers' docs show Super in the sound and
# action examples). 64.02 B parameters (published: 64 B).
COSMOS3_SUPER = {**COSMOS3_NANO, "hidden_size": 5120, "intermediate_size": 25600, "num_attention_heads": 64,
                 "num_hidden_layers": 64}
# nvidia/Cosmos3-Edge vae/config.json ("_name_or_path": Wan-AI/Wan2.2-TI2V-5B-Diffusers; nanoCosmos:
# the same Wan2.2-TI2V VAE for every tier); its "clip_output" key is no AutoencoderKLWan argument.
COSMOS3_VAE = {
    "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0, "is_residual": True,
    "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4,
    "latents_mean": [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813,
                     0.0891, 0.157, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108,
                     -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.123, -0.0313,
                     -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.052, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944,
                     0.3573, -0.0548, -0.1681, -0.0667],
    "latents_std": [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.499, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
                    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
                    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.06, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744],
}
# NVIDIA cosmos-framework's Diffusers converter DEFAULT_SOUND_TOKENIZER_CONFIG (= the class defaults):
# 48 kHz stereo, hop 2*4*5*6*8 = 1920 samples, so 25 latents/s (the transformer's sound_latent_fps).
COSMOS3_SOUND = {"sampling_rate": 48000, "vocoder_input_dim": 64, "dec_dim": 320, "dec_c_mults": [1, 2, 4, 8, 16],
                 "dec_strides": [2, 4, 5, 6, 8], "dec_out_channels": 2, "stereo": True}
# RECONSTRUCTED: UniPC on flow sigmas (order 2) with the flow shift and sigmas diffusers' Cosmos3 docs
# set for text-to-video (flow_shift 10.0, no Karras sigmas); the other fields are Wan's.
COSMOS3_SCHEDULER = ("UniPCMultistepScheduler", {**WAN_UNIPC, "flow_shift": 10.0})
# RECONSTRUCTED: Qwen's chat format for text messages (what the pipeline's apply_chat_template needs;
# the published Qwen3 template also handles images and tools).
QWEN_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
# Qwen3 ids (151,936 embedding rows; the specials at their Qwen ids); Qwen3-VL's 262,144 positions.
QWEN3_TOKENIZER = TokenizerSpec("text_tokenizer", 151936, 262144, QWEN_SPECIALS, pad="<|endoftext|>",
                                eos="<|im_end|>", append_eos=False, chat_template=QWEN_CHAT_TEMPLATE)
# The guardrail (cosmos_guardrail) cannot be downloaded here: written off (the published value is not
# known); docs/serving.md says how a deployment turns it on.
COSMOS3_INDEX = {"safety_checker": [None, None], "enable_safety_checker": False, "default_use_system_prompt": True,
                 "use_native_flow_schedule": False}


def _cosmos3(name: str, source: str, transformer: dict) -> Preset:
    return Preset(
        name, source, "Cosmos3OmniPipeline",
        # RECONSTRUCTED shard size: diffusers' default (10 GB)
        (Component("transformer", "diffusers", "Cosmos3OmniTransformer", transformer, max_shard_bytes=10 * GB,
                   layer_keys=("num_hidden_layers",)),
         Component("vae", "diffusers", "AutoencoderKLWan", COSMOS3_VAE, dtype="float32"),
         Component("sound_tokenizer", "diffusers", "Cosmos3AVAEAudioTokenizer", COSMOS3_SOUND, dtype="float32")),
        (QWEN3_TOKENIZER,), COSMOS3_SCHEDULER, COSMOS3_INDEX)


# ---- MiniMax-H3 ---------------------------------------------------------------------------------
# huggingface/diffusers scripts/convert_minimax_h3_to_diffusers.py MINIMAX_H3_TRANSFORMER_CONFIG (field
# for field the class defaults): 33.12 B parameters, 61.7 GiB ("61.7GB" in diffusers' docs).
MINIMAX_H3 = {
    "num_attention_heads": 56, "attention_head_dim": 128, "hidden_size": 5376, "num_layers": 50,
    "num_refiner_layers": 2, "ffn_dim": 14336, "in_channels": 24, "audio_in_channels": 32, "patch_size": [1, 2, 2],
    "text_dim": 5120, "freq_dim": 256, "time_embed_hidden_dim": 5376, "time_embed_dim": 2688, "rope_freq_dim": 16,
    "rope_theta": 10000.0, "norm_eps": 1e-5, "qk_norm_eps": 1e-5, "final_norm_eps": 1e-5,
}
# Qwen3-VL-32B (MiniMax-H3's text_encoder, Qwen3VLForConditionalGeneration): the config of a
# Qwen3-VL-32B fine-tune (huggingface.co/quanliang/F1 config.json); 66.7 GB, diffusers' docs' "62.1 GB".
QWEN3_VL_32B = {
    "text_config": {
        "vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
        "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "attention_bias": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                            "mrope_interleaved": True}},
    "vision_config": {
        "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "out_hidden_size": 5120,
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "hidden_act": "gelu_pytorch_tanh",
        "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24]},
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": False,
}
# The conversion script's MINIMAX_H3_VIDEO_VAE_CONFIG (the class defaults; "the released checkpoint
# is float32"); latents_mean / latents_std come from the checkpoint: RECONSTRUCTED as 0 / 1.
MINIMAX_H3_VAE = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 24, "block_out_channels": [128, 256, 256, 512, 512, 1024],
    "layers_per_block": 2, "spatial_downsample_factors": [2, 2, 2, 2, 1, 1],
    "temporal_downsample_factors": [1, 2, 2, 1, 1, 1], "norm_num_groups": 32, "decoder_num_layers": 36,
    "decoder_num_attention_heads": 32, "decoder_attention_head_dim": 64, "decoder_num_register_tokens": 4,
    "decoder_ffn_mult": 4, "clip_length": 17, "token_drop": 3, "latents_mean": [0.0] * 24, "latents_std": [1.0] * 24,
}
# audio_vae: the class defaults (800-sample hop at 32 kHz: the pipeline's 40 latents/s); latents
# statistics RECONSTRUCTED as 0 / 1.
MINIMAX_H3_AUDIO_VAE = {
    "encoder_dim": 64, "encoder_rates": [2, 4, 4, 5, 5], "latent_dim": 2048, "latent_channels": 32,
    "num_attention_heads": 8, "decoder_dim": 1024, "decoder_rates": [5, 5, 2, 2, 2, 2, 2],
    "decoder_kernel_sizes": [9, 9, 4, 4, 4, 4, 4], "resblock_kernel_sizes": [3, 7, 11],
    "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]], "sampling_rate": 32000,
    "latents_mean": [0.0] * 32, "latents_std": [1.0] * 32,
}
# processor/processor_config.json's image half, as in huggingface.co/tiny-random/minimax-h3.
QWEN3_VL_IMAGE_PROCESSOR = {
    "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.5] * 3,
    "image_std": [0.5] * 3, "merge_size": 2, "patch_size": 16, "resample": 3, "rescale_factor": 1 / 255,
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "temporal_patch_size": 2,
}
MINIMAX_TOKENIZER = TokenizerSpec("tokenizer", 151936, 262144, QWEN_SPECIALS, pad="<|endoftext|>", eos="<|im_end|>",
                                  append_eos=False)
# Video shift 12, audio shift 3 (the conversion script, diffusers' docs).
MINIMAX_SCHEDULER = ("MiniMaxH3Scheduler", {"shift": 12.0})
MINIMAX_AUDIO_SCHEDULER = ("audio_scheduler", "MiniMaxH3Scheduler", {"shift": 3.0})


def _minimax() -> Preset:
    return Preset(
        "minimax-h3", "MiniMaxAI/MiniMax-H3", "MiniMaxH3ModularPipeline",
        # 5 GiB shards (the conversion script's --max_shard_size default); transformer_ref/ (ref2va,
        # another 61.7 GiB) is not written: DLO does not serve ref2va.
        (Component("transformer", "diffusers", "MiniMaxH3Transformer3DModel", MINIMAX_H3, max_shard_bytes=5 * GIB,
                   layer_keys=("num_layers",)),
         # RECONSTRUCTED shard size: transformers' 5 GB
         Component("text_encoder", "transformers", "Qwen3VLForConditionalGeneration", QWEN3_VL_32B,
                   max_shard_bytes=5 * GB, layer_keys=("text_config.num_hidden_layers",), min_layers=51),
         Component("vae", "diffusers", "AutoencoderKLMiniMaxH3", MINIMAX_H3_VAE, dtype="float32"),
         Component("audio_vae", "diffusers", "AutoencoderKLMiniMaxH3Audio", MINIMAX_H3_AUDIO_VAE, dtype="float32")),
        (MINIMAX_TOKENIZER,), MINIMAX_SCHEDULER, extra_schedulers=(MINIMAX_AUDIO_SCHEDULER,),
        processor=QWEN3_VL_IMAGE_PROCESSOR, modular_blocks="MiniMaxH3Blocks")


# ---- tiny twins (CI): the same classes and layout, small dimensions --------------------------------
TINY_QWEN_SPECIALS = {"<|endoftext|>": 500, "<|im_start|>": 501, "<|im_end|>": 502, "<|vision_start|>": 503,
                      "<|vision_end|>": 504, "<|image_pad|>": 505, "<|video_pad|>": 506}


def _tiny_cosmos3() -> Preset:
    z = 8
    transformer = {
        "head_dim": 16, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
        "num_hidden_layers": 3, "vocab_size": 512, "latent_channel": z, "latent_patch_size": 2,
        "patch_latent_dim": 4 * z, "rope_axes_dim": [4, 2, 2], "rope_theta": 5000000.0, "hidden_act": "silu",
        "qk_norm_for_text": True, "sound_gen": True, "sound_dim": 8, "sound_latent_fps": 25.0}
    vae = {"base_dim": 8, "decoder_base_dim": 8, "z_dim": z, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1,
           "temperal_downsample": [False, True, True], "is_residual": True, "in_channels": 12, "out_channels": 12,
           "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4, "latents_mean": [0.0] * z,
           "latents_std": [1.0] * z}
    # hop 4*8*10 = 320 samples at 8 kHz: 25 latents/s, as the real 1920 at 48 kHz (8 kHz: AAC takes it)
    sound = {"sampling_rate": 8000, "vocoder_input_dim": 8, "dec_dim": 4, "dec_c_mults": [1, 2, 2],
             "dec_strides": [4, 8, 10], "dec_out_channels": 2, "encoder_enabled": False}
    tok = TokenizerSpec("text_tokenizer", 512, 4096, TINY_QWEN_SPECIALS, pad="<|endoftext|>", eos="<|im_end|>",
                        append_eos=False, chat_template=QWEN_CHAT_TEMPLATE)
    return Preset(
        "tiny-cosmos3", "tiny", "Cosmos3OmniPipeline",
        (Component("transformer", "diffusers", "Cosmos3OmniTransformer", transformer, "float32",
                   layer_keys=("num_hidden_layers",)),
         Component("vae", "diffusers", "AutoencoderKLWan", vae, "float32"),
         Component("sound_tokenizer", "diffusers", "Cosmos3AVAEAudioTokenizer", sound, "float32")),
        (tok,), COSMOS3_SCHEDULER, COSMOS3_INDEX)


def _tiny_minimax() -> Preset:
    text = 16
    transformer = {"num_attention_heads": 2, "attention_head_dim": 16, "hidden_size": 32, "num_layers": 3,
                   "num_refiner_layers": 2, "ffn_dim": 64, "in_channels": 4, "audio_in_channels": 4,
                   "patch_size": [1, 2, 2], "text_dim": text, "freq_dim": 16, "time_embed_hidden_dim": 32,
                   "time_embed_dim": 16, "rope_freq_dim": 2}  # 2 * 3 * rope_freq_dim <= head_dim
    encoder = {  # 51 decoder layers: the pipeline reads hidden state 50
        "text_config": {"vocab_size": 512, "hidden_size": text, "intermediate_size": 32, "num_hidden_layers": 51,
                        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
                        "max_position_embeddings": 4096,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 1, 1],
                                            "mrope_interleaved": True}},
        "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                          "out_hidden_size": text, "patch_size": 8, "spatial_merge_size": 2, "temporal_patch_size": 2,
                          "deepstack_visual_indexes": [0], "num_position_embeddings": 64},
        "image_token_id": 505, "video_token_id": 506, "vision_start_token_id": 503, "vision_end_token_id": 504,
        "tie_word_embeddings": False}
    # 4x spatial, 4x temporal: clip_length 17 / token_drop 3 keep the real 17n+5 -> 5n+2 frame geometry
    vae = {"latent_channels": 4, "block_out_channels": [8, 16], "layers_per_block": 1,
           "spatial_downsample_factors": [2, 2], "temporal_downsample_factors": [2, 2], "norm_num_groups": 4,
           "decoder_num_layers": 1, "decoder_num_attention_heads": 2, "decoder_attention_head_dim": 8,
           "decoder_num_register_tokens": 1, "decoder_ffn_mult": 2, "latents_mean": [0.0] * 4,
           "latents_std": [1.0] * 4}
    # hop 5*5*8 = 200 samples at 8 kHz: the pipeline's fixed 40 latents/s
    audio = {"encoder_dim": 4, "encoder_rates": [5, 5, 8], "latent_dim": 8, "latent_channels": 4,
             "num_attention_heads": 2, "decoder_dim": 8, "decoder_rates": [5, 5, 8], "decoder_kernel_sizes": [9, 9, 16],
             "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1]], "sampling_rate": 8000,
             "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4}
    processor = {**QWEN3_VL_IMAGE_PROCESSOR, "patch_size": 8, "size": {"shortest_edge": 256, "longest_edge": 4096}}
    tok = TokenizerSpec("tokenizer", 512, 4096, TINY_QWEN_SPECIALS, pad="<|endoftext|>", eos="<|im_end|>",
                        append_eos=False)
    return Preset(
        "tiny-minimax-h3", "tiny", "MiniMaxH3ModularPipeline",
        (Component("transformer", "diffusers", "MiniMaxH3Transformer3DModel", transformer, "float32",
                   layer_keys=("num_layers",)),
         Component("text_encoder", "transformers", "Qwen3VLForConditionalGeneration", encoder, "float32",
                   layer_keys=("text_config.num_hidden_layers",), min_layers=51),
         Component("vae", "diffusers", "AutoencoderKLMiniMaxH3", vae, "float32"),
         Component("audio_vae", "diffusers", "AutoencoderKLMiniMaxH3Audio", audio, "float32")),
        (tok,), MINIMAX_SCHEDULER, extra_schedulers=(MINIMAX_AUDIO_SCHEDULER,), processor=processor,
        modular_blocks="MiniMaxH3Blocks")


def omni_presets() -> dict[str, Preset]:
    presets = [_cosmos3("cosmos3-nano", "nvidia/Cosmos3-Nano", COSMOS3_NANO),
               _cosmos3("cosmos3-super", "nvidia/Cosmos3-Super", COSMOS3_SUPER), _minimax(),
               _tiny_cosmos3(), _tiny_minimax()]
    return {p.name: p for p in presets}
