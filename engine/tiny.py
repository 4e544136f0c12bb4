"""Write a small random diffusers-format pipeline folder (tests, the demo, benchmarks).

`dlo make-tiny-model OUT_DIR --family wan|flux` writes OUT_DIR/transformer (this module) and the
other pipeline components (VAE, text encoder, tokenizer, scheduler, model_index.json: see
`dlo.engine.tiny_pipeline`). Nothing is downloaded; every weight comes from a seeded generator.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# Wan needs head_dim splittable into (t, h, w) rope parts; Flux's rope axes must sum to head_dim.
HEAD_DIM = 16


def transformer_config(family: str, layers: int, dim: int, in_channels: int = 16, text_dim: int = 32) -> dict:
    if dim % HEAD_DIM:
        raise ValueError(f"--dim must be a multiple of {HEAD_DIM}, got {dim}")
    heads = dim // HEAD_DIM
    if family == "wan":
        return {
            "_class_name": "WanTransformer3DModel",
            "patch_size": [1, 2, 2],
            "num_attention_heads": heads,
            "attention_head_dim": HEAD_DIM,
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
    if family == "flux":
        # Flux runs `layers` double-stream blocks then `layers + 1` single-stream blocks: two block
        # kinds of different sizes and an odd total, which the offload tests rely on.
        return {
            "_class_name": "FluxTransformer2DModel",
            "patch_size": 1,
            "in_channels": in_channels * 4,
            "num_layers": layers,
            "num_single_layers": layers + 1,
            "attention_head_dim": HEAD_DIM,
            "num_attention_heads": heads,
            "joint_attention_dim": text_dim,
            "pooled_projection_dim": text_dim,
            "guidance_embeds": False,
            "axes_dims_rope": [4, 6, 6],
        }
    raise ValueError(f"unknown family {family!r}; choose wan or flux")


def make_tiny_transformer(
    out_dir: Path | str,
    family: str = "wan",
    layers: int = 3,
    dim: int = 32,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | int | None = None,
    in_channels: int = 16,
    text_dim: int = 32,
) -> Path:
    """Write a random transformer folder (config.json + safetensors) and return its path.

    Modules in the class's `_keep_in_fp32_modules` stay float32 whatever `dtype` is, as
    diffusers' own `save_pretrained` of a half-precision model leaves them.
    """
    import diffusers
    import torch

    config = transformer_config(family, layers, dim, in_channels, text_dim)
    cls = getattr(diffusers, config["_class_name"])
    torch.manual_seed(seed)
    model = cls.from_config({k: v for k, v in config.items() if not k.startswith("_")})
    # Default inits leave some weights at exactly 0 or 1; random values make every weight matter.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 / max(1, p.shape[-1]) ** 0.5))
    target = getattr(torch, dtype)
    keep = set(getattr(cls, "_keep_in_fp32_modules", None) or [])
    for name, p in model.named_parameters():
        if not keep.intersection(name.split(".")):
            p.data = p.data.to(target)
    out = Path(out_dir)
    kwargs = {"safe_serialization": True}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    log.info("wrote tiny %s transformer to %s", family, out)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", type=Path, help="folder to write the pipeline into (created)")
    parser.add_argument("--family", choices=["wan", "flux"], default="wan")
    parser.add_argument("--layers", type=int, default=3, help="transformer blocks (flux: double-stream blocks)")
    parser.add_argument("--dim", type=int, default=32, help=f"hidden size, a multiple of {HEAD_DIM}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--transformer-only", action="store_true", help="write only OUT_DIR/transformer")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out: Path = args.out_dir
    make_tiny_transformer(out / "transformer", args.family, args.layers, args.dim, args.seed, args.dtype)
    if not args.transformer_only:
        from dlo.engine.tiny_pipeline import write_pipeline_components

        write_pipeline_components(out, family=args.family, seed=args.seed, dtype=args.dtype)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(json.dumps({"path": str(out), "family": args.family, "bytes": size}))
    return 0
