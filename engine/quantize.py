"""`dlo quantize SRC DST --dtype fp8`: a pipeline folder whose transformers' linear weights are float8
e4m3 with a float32 scale per output row beside each (`dlo.engine.fp8`), served with `dlo serve DST
--stream-dtype fp8`; and the arithmetic both that and the engine's load use.

Owns: `quantize_fp8` (one weight -> FP8 values and scales), `dequantize_into` (FP8 values and scales
-> the compute dtype, into a given tensor: the one function every mode dequantizes with, so bytes are
identical across modes), `InMemoryFp8` (a bfloat16 folder's FP8 bytes computed at load, for the arena),
and the subcommand: the transformers rewritten (same files and sharding, each weight the rule picks
replaced by its FP8 bytes and its scale added beside it), every other component and file hard-linked
(copied across filesystems), written into `DST.partial` and renamed when complete.
Must never: write into SRC, leave a half-written DST, or quantize what `dlo.engine.fp8.quantizable`
leaves out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Iterable

import torch

from dlo.engine.fp8 import CONVERTIBLE, E4M3_MAX, SCALE_SUFFIX, quantizable, stored_weights

# the smallest scale: a row of zeros quantizes to zeros (no division by zero)
_TINY = torch.finfo(torch.float32).tiny


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, scale)` of a 2-D weight: `scale[r] = max |weight[r]| / 448` (float32), `q = weight / scale`
    rounded to float8 e4m3 (round to nearest even; |q| <= 448, so nothing saturates)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp(min=_TINY)
    return (w / scale.unsqueeze(1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def dequantize_into(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`out = q * scale[:, None]` in `out`'s dtype: FP8 to `out` exactly, then one multiply in float32
    rounded once (two kernels, no temporary the size of the weight)."""
    out.copy_(q)
    out.mul_(scale.unsqueeze(1))
    return out


def resident_fp8(ckpt: Any, plan: Any, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 weight placed whole on the device in `dtype` (a resident block, resident mode): its
    stored or converted values dequantized on the device, as a streamed block's are."""
    if plan.stored:
        q, scale = ckpt.view(name), ckpt.view(plan.quantized[name])
    else:
        q, scale = quantize_fp8(ckpt.view(name))
    out = torch.empty(q.shape, dtype=dtype, device=device)
    return dequantize_into(out, q.to(device), scale.to(device))


class InMemoryFp8:
    """The FP8 bytes of a bfloat16 checkpoint's weights, computed when the arena asks for them
    (`--stream-dtype fp8` on a folder `dlo quantize` has not converted). The last weight's values
    are kept: a weight's scale and its values are asked for one after the other."""

    def __init__(self, ckpt: Any, quantized: dict[str, str]):
        self.ckpt = ckpt
        self.by_scale = {s: w for w, s in quantized.items()}
        self.quantized = quantized
        self._last: tuple[str, torch.Tensor, torch.Tensor] | None = None

    def _of(self, weight: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._last is None or self._last[0] != weight:
            q, s = quantize_fp8(self.ckpt.view(weight))
            self._last = (weight, q, s)
        return self._last[1], self._last[2]

    def bytes_of(self, name: str) -> torch.Tensor | None:
        """The uint8 bytes of `name` (an FP8 weight or its scale), None for other tensors."""
        if name in self.quantized:
            return self._of(name)[0].view(torch.uint8).flatten()
        if name in self.by_scale:
            return self._of(self.by_scale[name])[1].view(torch.uint8).flatten()
        return None


# ---- dlo quantize ---------------------------------------------------------------------------------
class QuantizeError(ValueError):
    """Input `dlo quantize` refuses: the message names the argument and what to do."""


def quantize_folder(src: Path, dst: Path, *, show_progress: bool = True) -> dict:
    """SRC's pipeline with its transformers' linear weights in FP8, at DST (module docstring)."""
    from dlo.engine.checkpoint import CheckpointError, cached_checkpoint
    from dlo.engine.families import pipeline_facts

    try:
        facts = pipeline_facts(src)
        ckpts = {name: cached_checkpoint(src / name) for name in facts.transformers}
    except (CheckpointError, ValueError, KeyError, OSError) as e:
        raise QuantizeError(f"SRC {src}: not a pipeline folder dlo can read ({e})") from None
    for name, ckpt in ckpts.items():
        if stored_weights(ckpt):
            raise QuantizeError(f"SRC {src}: {name} already holds FP8 weights")
    need = sum(_fp8_bytes(c, src / name) for name, c in ckpts.items())
    partial = dst.with_name(dst.name + ".partial")
    dst.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dst.parent).free
    if need > free:
        raise QuantizeError(f"DST {dst}: the FP8 transformers need {need / 2**30:.2f} GiB and "
                            f"{free / 2**30:.2f} GiB are free on its filesystem")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        bar = _bar(sum(c.nbytes for c in ckpts.values()), show_progress)
        counts = {name: _write_component(ckpt, src / name, partial / name, bar) for name, ckpt in ckpts.items()}
        bar.close()
        linked = _link_rest(src, partial, set(ckpts))
        os.sync()
        partial.rename(dst)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return {"path": str(dst), "dtype": "fp8", "quantized_weights": counts, "bytes": need, "linked": linked}


def _fp8_bytes(ckpt: Any, component: Path) -> int:
    """What a checkpoint takes with the rule's weights in FP8 (one byte each) and their scales."""
    chosen = _chosen(ckpt, component)
    return sum(info.nbytes if name not in chosen else info.nbytes // _itemsize(info) + 4 * info.shape[0]
               for name, info in ckpt.tensors.items())


def _itemsize(info: Any) -> int:
    from dlo.engine.checkpoint import DTYPE_SIZES

    return DTYPE_SIZES[info.dtype]


def _chosen(ckpt: Any, component: Path) -> set[str]:
    """The weights the rule quantizes: the linear weights of the model's blocks (the engine's grouping)."""
    from dlo.engine.blocks import group_keys
    from dlo.engine.families import family_of, read_config

    blocks, _ = group_keys(set(ckpt.tensors), family_of(read_config(component)["_class_name"]))
    return {k for b in blocks for k in b.keys
            if quantizable(k, ckpt.tensors[k].shape) and ckpt.tensors[k].dtype in CONVERTIBLE}


def _write_component(ckpt: Any, src: Path, dst: Path, bar: Any) -> int:
    """One transformer: the same files (each tensor in the file it was in), FP8 weights and scales."""
    from dlo.engine.dtypes import torch_dtype
    from dlo.engine.random_model import write_safetensors

    chosen = _chosen(ckpt, src)
    files = sorted({info.path for info in ckpt.tensors.values()})
    specs: list[tuple[str, Any, tuple[int, ...]]] = []
    cut: set[int] = set()
    for path in files:
        if specs:
            cut.add(len(specs))
        for name, info in sorted(ckpt.tensors.items()):
            if info.path != path:
                continue
            if name in chosen:
                specs += [(name, torch.float8_e4m3fn, info.shape), (name + SCALE_SUFFIX, torch.float32, (info.shape[0],))]
            else:
                specs.append((name, torch_dtype(info.dtype), info.shape))
    fp8 = InMemoryFp8(ckpt, {n: n + SCALE_SUFFIX for n in chosen})

    def fill(name: str, shape: tuple[int, ...], dtype: Any) -> Iterable[torch.Tensor]:
        derived = fp8.bytes_of(name)
        if derived is not None:
            if name in chosen:
                bar.update(ckpt.tensors[name].nbytes)
            yield derived.view(dtype).view(shape)
            return
        bar.update(ckpt.tensors[name].nbytes)
        yield ckpt.view(name)

    stem = re.sub(r"(-\d{5}-of-\d{5})?\.safetensors$", "", files[0].name)
    write_safetensors(dst, specs, stem=stem, fill=fill, cut_after=cut)
    for extra in src.iterdir():  # config.json and anything that is no weight
        if extra.is_file() and not extra.name.endswith((".safetensors", ".safetensors.index.json")):
            _link_or_copy(extra, dst / extra.name)
    return len(chosen)


def _link_rest(src: Path, dst: Path, done: set[str]) -> int:
    """Every other file of SRC at the same place in DST: hard links (no bytes) or copies."""
    n = 0
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if rel.parts[0] in done or path.is_dir():
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        _link_or_copy(path, dst / rel)
        n += 1
    return n


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links refused: a copy
        shutil.copy2(src, dst)


def _bar(total: int, show: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="quantize", disable=not show)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dlo.cli.args import new_folder

    parser.add_argument("src", type=Path, help="a diffusers pipeline folder (model_index.json, transformer/, ...)")
    parser.add_argument("dst", type=new_folder, help="the folder to write (new or empty); other components are "
                                                     "hard-linked from SRC where the filesystem allows, else copied")
    parser.add_argument("--dtype", choices=("fp8",), required=True,
                        help="fp8: float8 e4m3 with a float32 scale per output row for each linear weight of the "
                             "transformers' blocks; norms, biases, embeddings and small tensors stay as they are. "
                             "Serve it with `dlo serve DST --stream-dtype fp8`")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    src, dst = args.src.resolve(), args.dst.resolve()
    if src == dst or src in dst.parents:
        print(f"dlo quantize: DST {dst} lies inside SRC {src}; choose a folder outside it", file=sys.stderr)
        return 2
    try:
        if dst.exists():
            dst.rmdir()  # new_folder checked it is empty: the rename needs it gone
        summary = quantize_folder(src, dst, show_progress=not args.no_progress)
    except (QuantizeError, OSError) as e:
        print(f"dlo quantize: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0
