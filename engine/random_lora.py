"""Write a LoRA adapter with seeded random weights for any model folder (`dlo make-random-lora`).

`dlo make-random-lora MODEL_DIR OUT --rank R [--seed S] [--alpha A] [--targets blocks|attention]
[--format diffusers|alpha-keys|wan-original|kohya]` builds the transformer of MODEL_DIR (a pipeline
folder, or a transformer folder) on the meta device and writes one `lora_A`/`lora_B` pair per
targeted linear layer of its blocks: OUT/pytorch_lora_weights.safetensors (or OUT itself when it
ends in `.safetensors`), tensor by tensor with a progress bar, so a full-size Wan2.1-14B adapter is
written without holding it in memory. Formats: `diffusers` (what the pipeline's save_lora_weights
writes: `transformer.<module>.lora_A.weight`, header metadata `lora_adapter_metadata` with r and
lora_alpha), `alpha-keys` (the same keys plus `transformer.<module>.alpha`, no metadata: Flux reads
them as network alphas), `wan-original` (Wan's own names, `diffusion_model.blocks.N.self_attn.q`,
with `.alpha`) and `kohya` (Flux sd-scripts names, `lora_unet_double_blocks_N_img_attn_qkv` with
`lora_down`/`lora_up` and `.alpha`, q/k/v fused): the community formats diffusers converts on load.

Values: A ~ N(0, 1/in), B ~ N(0, (0.05)^2/r), so a layer's branch is about 5% of its input's size:
visible in every output, far from breaking it.
Owns: the adapter writer and the subcommand.
Must never: touch the model folder, or write a file the pipeline's `load_lora_weights` would not read.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from dlo.cli.args import existing_dir, fail, positive_int

FORMATS = ("diffusers", "alpha-keys", "wan-original", "kohya")
B_SCALE = 0.05

# Wan's original module names, from diffusers' (what `_convert_non_diffusers_wan_lora_to_diffusers` undoes)
_WAN_ORIGINAL = [(r"^blocks\.(\d+)\.attn1\.", r"blocks.\1.self_attn."), (r"^blocks\.(\d+)\.attn2\.", r"blocks.\1.cross_attn."),
                 (r"\.to_q$", ".q"), (r"\.to_k$", ".k"), (r"\.to_v$", ".v"), (r"\.to_out\.0$", ".o"),
                 (r"\.add_k_proj$", ".k_img"), (r"\.add_v_proj$", ".v_img"),
                 (r"\.ffn\.net\.0\.proj$", ".ffn.0"), (r"\.ffn\.net\.2$", ".ffn.2")]
# Flux's sd-scripts (kohya) names: each entry one A (lora_down) over the diffusers modules it feeds
_KOHYA_DOUBLE = {"img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"), "img_attn_proj": ("attn.to_out.0",),
                 "img_mlp_0": ("ff.net.0.proj",), "img_mlp_2": ("ff.net.2",), "img_mod_lin": ("norm1.linear",),
                 "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
                 "txt_attn_proj": ("attn.to_add_out",), "txt_mlp_0": ("ff_context.net.0.proj",),
                 "txt_mlp_2": ("ff_context.net.2",), "txt_mod_lin": ("norm1_context.linear",)}
_KOHYA_SINGLE = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), "linear2": ("proj_out",),
                 "modulation_lin": ("norm.linear",)}
# diffusers splits a single block's linear1 at Flux.1's own sizes only
_KOHYA_LINEAR1 = [3072, 3072, 3072, 12288]


@dataclass(frozen=True)
class Pair:
    """One down/up pair of the file: its key prefix, key names, input and (stacked) output features."""

    prefix: str
    down: str
    up: str
    in_features: int
    out_features: int
    alpha: bool


def target_layers(transformer_dir: Path, targets: str) -> tuple[dict[str, tuple[int, int, Any]], str]:
    """The targeted linear layers of the transformer's blocks, `{path: (in, out, torch dtype)}` in
    execution order, and the model's class name."""
    import torch

    from dlo.engine.checkpoint import cached_checkpoint
    from dlo.engine.dtypes import torch_dtype
    from dlo.engine.model import build_meta_model

    meta = build_meta_model(transformer_dir, cached_checkpoint(transformer_dir))
    layers = {}
    for list_name in meta.family.block_lists:
        for i, block in enumerate(meta.module.get_submodule(list_name)):
            for name, mod in block.named_modules():
                if isinstance(mod, torch.nn.Linear) and (targets == "blocks" or name.startswith("attn")):
                    path = f"{list_name}.{i}.{name}"
                    layers[path] = (mod.in_features, mod.out_features, torch_dtype(meta.target_dtype[f"{path}.weight"]))
    return layers, type(meta.module).__name__


def pairs(fmt: str, layers: dict[str, tuple[int, int, Any]]) -> list[Pair]:
    """The file's pairs for `layers` in format `fmt` (ValueError: the format cannot hold them)."""
    if fmt in ("diffusers", "alpha-keys"):
        return [Pair(f"transformer.{m}", "lora_A", "lora_B", i, o, fmt == "alpha-keys") for m, (i, o, _) in layers.items()]
    if fmt == "wan-original":
        out = []
        for m, (i, o, _) in layers.items():
            name = m
            for pattern, repl in _WAN_ORIGINAL:
                name = re.sub(pattern, repl, name)
            if name == m:
                raise ValueError(f"--format wan-original has no name for {m} (Wan blocks only)")
            out.append(Pair(f"diffusion_model.{name}", "lora_A", "lora_B", i, o, True))
        return out
    return _kohya(layers)


def _kohya(layers: dict[str, tuple[int, int, Any]]) -> list[Pair]:
    out = []
    for list_name, kind, table in (("transformer_blocks", "double", _KOHYA_DOUBLE),
                                   ("single_transformer_blocks", "single", _KOHYA_SINGLE)):
        indices = sorted({int(m.split(".")[1]) for m in layers if m.startswith(list_name + ".")})
        for i in indices:
            for key, modules in table.items():
                full = [f"{list_name}.{i}.{m}" for m in modules]
                if not all(f in layers for f in full):
                    continue
                outs = [layers[f][1] for f in full]
                if key == "linear1" and outs != _KOHYA_LINEAR1:
                    continue  # diffusers' converter splits linear1 at Flux.1's sizes only
                out.append(Pair(f"lora_unet_{kind}_blocks_{i}_{key}", "lora_down", "lora_up", layers[full[0]][0],
                                sum(outs), True))
    if not out:
        raise ValueError("--format kohya is for Flux transformers (transformer_blocks, single_transformer_blocks)")
    return out


def _check_rank_and_alpha(rank: int, alpha: float, chosen: list[Pair]) -> None:
    """ValueError (one line) before anything is allocated: a rank above a targeted layer's smaller
    dimension, or an alpha that is not finite or beyond what the start check of `dlo serve` takes."""
    from dlo.engine.lora.limits import MAX_ABS_ALPHA

    smallest = min(min(p.in_features, p.out_features) for p in chosen)
    if rank > smallest:
        raise ValueError(f"--rank {rank} exceeds {smallest}, the smaller dimension of a targeted layer (a LoRA's "
                         "rank is at most that)")
    if not math.isfinite(alpha) or abs(alpha) > MAX_ABS_ALPHA:
        raise ValueError(f"--alpha {alpha:g} must be a finite number between -{MAX_ABS_ALPHA:g} and {MAX_ABS_ALPHA:g}")


def write_adapter(model_dir: Path, out: Path, *, rank: int, alpha: float | None = None, seed: int = 0,
                  targets: str = "blocks", fmt: str = "diffusers", dtype: str = "auto",
                  show_progress: bool = False) -> dict:
    """Write the adapter (see the module docstring); returns what was written."""
    import torch

    from dlo.engine.random_model import _progress, write_safetensors

    t0 = time.perf_counter()
    transformer_dir = model_dir / "transformer" if (model_dir / "transformer" / "config.json").exists() else model_dir
    layers, class_name = target_layers(transformer_dir, targets)
    if not layers:
        raise ValueError(f"{transformer_dir}: no linear layers in the blocks of {class_name}")
    alpha = float(rank if alpha is None else alpha)
    chosen = pairs(fmt, layers)
    _check_rank_and_alpha(rank, alpha, chosen)
    layer_dtype = next(iter(layers.values()))[2]
    wdtype = layer_dtype if dtype == "auto" else getattr(torch, dtype)
    specs: list[tuple[str, Any, tuple[int, ...]]] = []
    for p in chosen:
        specs += [(f"{p.prefix}.{p.down}.weight", wdtype, (rank, p.in_features)),
                  (f"{p.prefix}.{p.up}.weight", wdtype, (p.out_features, rank))]
        if p.alpha:
            specs.append((f"{p.prefix}.alpha", torch.float32, ()))
    metadata = None
    if fmt == "diffusers":
        config = {"transformer.r": rank, "transformer.lora_alpha": alpha,
                  "transformer.target_modules": sorted(layers)}
        metadata = {"lora_adapter_metadata": json.dumps(config)}
    file = out if out.suffix == ".safetensors" else out / "pytorch_lora_weights.safetensors"
    gen = torch.Generator("cpu").manual_seed(seed)

    def fill(name: str, shape: tuple[int, ...], dt: Any) -> Iterable[Any]:
        if name.endswith(".alpha"):
            yield torch.tensor([alpha], dtype=dt)  # the bytes of the 0-dim tensor
        elif f".{chosen[0].down}." in name:
            yield (torch.randn(shape, generator=gen) / shape[1] ** 0.5).to(dt)
        else:
            yield (torch.randn(shape, generator=gen) * (B_SCALE / rank ** 0.5)).to(dt)

    total = sum(dt.itemsize * (shape[0] * shape[1] if shape else 1) for _, dt, shape in specs)
    bar = _progress(total, show_progress)
    info = write_safetensors(file.parent, specs, stem=file.stem, fill=fill, progress=bar, metadata=metadata)
    bar(0, close=True)
    return {"path": str(file), "format": fmt, "rank": rank, "alpha": alpha, "targets": targets,
            "modules": len(layers), "pairs": len(chosen), "dtype": str(wdtype).removeprefix("torch."),
            "bytes": info["bytes"], "seconds": round(time.perf_counter() - t0, 2)}


# ---- the subcommand -----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", type=existing_dir, help="a pipeline folder (its transformer/) or a transformer folder")
    parser.add_argument("out", type=Path, help="the adapter: a folder to create (holding "
                        "pytorch_lora_weights.safetensors, what `dlo serve --lora-dir` lists as NAME/), or a file "
                        "NAME.safetensors")
    parser.add_argument("--rank", type=positive_int, required=True, help="LoRA rank r of every layer")
    parser.add_argument("--alpha", type=float, default=None,
                        help="lora_alpha (the branch is scaled by alpha / r); default: r (scale 1)")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same bytes")
    parser.add_argument("--targets", choices=("blocks", "attention"), default="blocks",
                        help="blocks: every linear layer of every block; attention: the attention projections only")
    parser.add_argument("--format", dest="fmt", choices=FORMATS, default="diffusers",
                        help="diffusers (save_lora_weights' own), or a format diffusers converts on load: alpha-keys, "
                             "wan-original (Wan), kohya (Flux)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="dtype of A and B; auto: the layers' own (diffusers casts to it on load anyway)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    prog = "dlo make-random-lora"
    file = args.out if args.out.suffix == ".safetensors" else args.out / "pytorch_lora_weights.safetensors"
    if file.exists() or (args.out.is_dir() and any(args.out.iterdir())):
        return fail(prog, f"{args.out} already exists; choose a new path")
    from dlo.engine.checkpoint import CheckpointError

    try:
        summary = write_adapter(args.model_dir, args.out, rank=args.rank, alpha=args.alpha, seed=args.seed,
                                targets=args.targets, fmt=args.fmt, dtype=args.dtype,
                                show_progress=not args.no_progress)
    except (CheckpointError, KeyError, ValueError, OSError) as e:
        return fail(prog, e)
    print(json.dumps(summary))
    return 0
