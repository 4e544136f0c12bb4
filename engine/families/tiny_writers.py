"""Each family's tiny random pipeline (tests, the demo, benchmarks): the tiny-model writers.

Owns: `TinyWriter` (what `dlo make-tiny-model` needs of a family: its tiny transformer config and
every other component of its pipeline folder), `WanTiny` and `FluxTiny`, `TINY_WRITERS` (keyed by
`dlo.engine.families.FAMILIES` names), and the pieces they share: seeded random weights, byte-level
tokenizers (no merges: any prompt tokenizes, the vocabulary stays 260 entries), the flow-matching
scheduler. `dlo.engine.families.tiny` writes the transformer and runs the subcommand.
Must never: download anything, or import torch, diffusers, transformers or tokenizers at import
time (the writers import them inside their methods).
"""

from __future__ import annotations

from pathlib import Path

# Wan needs head_dim splittable into (t, h, w) rope parts; Flux's rope axes must sum to head_dim.
HEAD_DIM = 16
# Must match the transformer's text_dim / joint_attention_dim / pooled_projection_dim.
TEXT_DIM = 32
SPECIALS = ["<pad>", "</s>", "<unk>", "<s>"]  # ids 0..3
VOCAB_SIZE = 256 + len(SPECIALS)
CLIP_MAX_LENGTH = 77
# Wan's UMT5 and Flux's T5 encoders: the same tiny shape.
T5_CONFIG = dict(
    vocab_size=VOCAB_SIZE, d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
    relative_attention_num_buckets=8, relative_attention_max_distance=32,
    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
)


def byte_level_tokenizer(model_max_length: int, bos: bool):
    """A PreTrainedTokenizerFast over single bytes (no merges), appending `</s>` to every text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", special_tokens=[("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])]
        )
    else:
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", vocab["</s>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        bos_token="<s>",
        model_max_length=model_max_length,
    )


def _randomize(model, seed: int) -> None:
    """Replace default inits (many exact zeros and ones) so every weight shapes the output."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / max(1, p[0].numel()) ** 0.5))


def save_random(model, path: Path, dtype: str, seed: int) -> None:
    import torch

    _randomize(model, seed)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)


def flow_scheduler(out: Path, **config) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    FlowMatchEulerDiscreteScheduler(**config).save_pretrained(out / "scheduler")


class TinyWriter:
    """The tiny-model writer of one pipeline family."""

    def transformer_config(self, layers: int, dim: int, head_dim: int, in_channels: int, text_dim: int) -> dict:
        """The tiny transformer's config.json (`_class_name` and the constructor's arguments)."""
        raise NotImplementedError

    def write_components(self, out: Path, seed: int, dtype: str) -> dict:
        """Write every component but the transformer into `out`; returns model_index.json's content."""
        raise NotImplementedError


class WanTiny(TinyWriter):
    """A tiny `WanPipeline`: UMT5 text encoder, Wan VAE (8x spatial, 4x temporal), flow scheduler."""

    def transformer_config(self, layers: int, dim: int, head_dim: int, in_channels: int, text_dim: int) -> dict:
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

    def write_components(self, out: Path, seed: int, dtype: str) -> dict:
        import torch
        from diffusers import AutoencoderKLWan
        from transformers import UMT5Config, UMT5EncoderModel

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


class FluxTiny(TinyWriter):
    """A tiny `FluxPipeline`: CLIP and T5 text encoders, a 16-channel VAE, flow scheduler."""

    def transformer_config(self, layers: int, dim: int, head_dim: int, in_channels: int, text_dim: int) -> dict:
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

    def write_components(self, out: Path, seed: int, dtype: str) -> dict:
        import torch
        from diffusers import AutoencoderKL
        from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

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


# `dlo make-tiny-model --family` (the order is its help's)
TINY_WRITERS: dict[str, TinyWriter] = {"wan": WanTiny(), "flux": FluxTiny()}
