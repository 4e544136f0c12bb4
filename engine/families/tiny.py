"""Write a small random diffusers-format pipeline folder (tests, the demo, benchmarks).

`dlo make-tiny-model OUT_DIR --family wan|flux` writes OUT_DIR/transformer and the other pipeline
components (VAE, text encoder(s), tokenizer(s), scheduler, model_index.json).

Owns: the transformer writer (random seeded weights, `_keep_in_fp32_modules` kept float32), the
pipeline folder's `model_index.json`, and the `make-tiny-model` subcommand; each family's tiny
transformer config and other components are its writer's (`dlo.engine.families.tiny_writers`).
Must never: download anything (tokenizers are built locally with the `tokenizers` library).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from dlo.cli.args import new_folder, positive_int
from dlo.engine.families.tiny_writers import HEAD_DIM, TEXT_DIM, TINY_WRITERS, TinyWriter

log = logging.getLogger(__name__)


def write_pipeline_components(out_dir: Path | str, *, family: str = "wan", seed: int = 0, dtype: str = "float32") -> Path:
    """Write everything but the transformer into `out_dir` (which holds or will hold `transformer/`)."""
    import diffusers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = _writer(family).write_components(out, seed, dtype)
    index["_diffusers_version"] = diffusers.__version__
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    log.info("wrote tiny %s pipeline components to %s", family, out)
    return out


def _writer(family: str) -> TinyWriter:
    if family not in TINY_WRITERS:
        raise ValueError(f"unknown family {family!r}; choose {' or '.join(TINY_WRITERS)}")
    return TINY_WRITERS[family]


def transformer_config(family: str, layers: int, dim: int, in_channels: int = 16, text_dim: int = TEXT_DIM) -> dict:
    if dim % HEAD_DIM:
        raise ValueError(f"--dim must be a multiple of {HEAD_DIM}, got {dim}")
    return _writer(family).transformer_config(layers, dim, HEAD_DIM, in_channels, text_dim)


def make_tiny_transformer(
    out_dir: Path | str,
    family: str = "wan",
    layers: int = 3,
    dim: int = 32,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | int | None = None,
    in_channels: int = 16,
    text_dim: int = TEXT_DIM,
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


def _dim(text: str) -> int:
    value = positive_int(text)
    if value % HEAD_DIM:
        raise argparse.ArgumentTypeError(f"must be a multiple of {HEAD_DIM} (the head size; got {value})")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", type=new_folder, help="folder to write the pipeline into (created; must be new or empty)")
    parser.add_argument("--family", choices=list(TINY_WRITERS), default="wan")
    parser.add_argument("--layers", type=positive_int, default=3, help="transformer blocks (flux: double-stream blocks)")
    parser.add_argument("--dim", type=_dim, default=32, help=f"hidden size, a multiple of {HEAD_DIM}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--transformer-only", action="store_true", help="write only OUT_DIR/transformer")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out: Path = args.out_dir
    make_tiny_transformer(out / "transformer", args.family, args.layers, args.dim, args.seed, args.dtype)
    if not args.transformer_only:
        write_pipeline_components(out, family=args.family, seed=args.seed, dtype=args.dtype)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(json.dumps({"path": str(out), "family": args.family, "bytes": size}))
    return 0
