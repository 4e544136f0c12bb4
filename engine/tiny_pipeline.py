"""The non-transformer components of a tiny random diffusers pipeline (tests, the demo, benchmarks).

Owns: writing the VAE, text encoder(s), tokenizer(s), scheduler and `model_index.json` next to a
tiny transformer written by `dlo.engine.tiny`, so that `WanPipeline` / `FluxPipeline`
`.from_pretrained(dir)` loads the folder offline.
Must never: download anything. Tokenizers are built locally with the `tokenizers` library (a
byte-level vocabulary with no merges: any prompt tokenizes, the vocabulary stays 260 entries).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# Must match the transformer's text_dim / joint_attention_dim / pooled_projection_dim (tiny.py).
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


def _byte_level_tokenizer(model_max_length: int, bos: bool):
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


def _save(model, path: Path, dtype: str, seed: int) -> None:
    import torch

    _randomize(model, seed)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)


def _flow_scheduler(out: Path, **config) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    FlowMatchEulerDiscreteScheduler(**config).save_pretrained(out / "scheduler")


def _write_wan(out: Path, seed: int, dtype: str) -> dict:
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    # Three spatial downsamples (8x) and two temporal ones (4x), as the real Wan VAE: the pipeline
    # derives its scale factors from this config.
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
    # The VAE is the one component kept float32: its decoder output becomes the image bytes.
    _save(vae, out / "vae", "float32", seed + 1)
    enc = UMT5EncoderModel(UMT5Config(**T5_CONFIG))
    _save(enc, out / "text_encoder", dtype, seed + 2)
    _byte_level_tokenizer(512, bos=False).save_pretrained(out / "tokenizer")
    _flow_scheduler(out, shift=5.0)
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


def _write_flux(out: Path, seed: int, dtype: str) -> dict:
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
    _save(vae, out / "vae", "float32", seed + 1)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=VOCAB_SIZE, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=CLIP_MAX_LENGTH, projection_dim=TEXT_DIM,
            pad_token_id=0, bos_token_id=3, eos_token_id=1,
        )
    )
    _save(clip, out / "text_encoder", dtype, seed + 2)
    t5 = T5EncoderModel(T5Config(**T5_CONFIG))
    _save(t5, out / "text_encoder_2", dtype, seed + 3)
    _byte_level_tokenizer(CLIP_MAX_LENGTH, bos=True).save_pretrained(out / "tokenizer")
    _byte_level_tokenizer(512, bos=False).save_pretrained(out / "tokenizer_2")
    _flow_scheduler(
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


def write_pipeline_components(out_dir: Path | str, *, family: str = "wan", seed: int = 0, dtype: str = "float32") -> Path:
    """Write everything but the transformer into `out_dir` (which holds or will hold `transformer/`)."""
    import diffusers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    writers = {"wan": _write_wan, "flux": _write_flux}
    if family not in writers:
        raise ValueError(f"unknown family {family!r}; choose wan or flux")
    index = writers[family](out, seed, dtype)
    index["_diffusers_version"] = diffusers.__version__
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    log.info("wrote tiny %s pipeline components to %s", family, out)
    return out
