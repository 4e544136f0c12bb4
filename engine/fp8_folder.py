"""`dlo quantize SRC DST --dtype fp8`: a pipeline folder whose transformers' linear weights are float8
e4m3 with a float32 scale per output row beside each (`dlo.engine.fp8`), served with `dlo serve DST
--stream-dtype fp8`.

Owns: the subcommand (`add_arguments`, `main`) and `quantize_folder`: the transformers rewritten
(same files and sharding, each weight the rule picks replaced by its FP8 bytes and its scale added
beside it; the values from `dlo.engine.quantize`), every other component and file hard-linked
(copied across filesystems), written into `DST.partial` and renamed when complete (the steps of
`dlo.engine.staged_folder`). `DST.partial` is made with the marker of `dlo.delivery.owned`: a later
run removes it only when it carries that marker and the run that made it is gone (a killed run's;
there is nothing to resume), and refuses one without it; SRC and DST (or `DST.partial`) inside one
another are refused (`check_paths`).
Must never: write into or delete SRC, delete a folder it did not make, leave a half-written DST,
quantize what `dlo.engine.fp8.quantizable` leaves out, or import torch before the arguments and
SRC's headers are checked (a bad argument is a one-line exit 2 at once).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Iterable

from dlo.engine.fp8 import CONVERTIBLE, SCALE_SUFFIX, quantizable, stored_weights
from dlo.engine.staged_folder import (
    FolderError,
    check_free,
    check_paths,
    claim,
    link_or_copy,
    link_rest,
    progress_bar,
    publish,
    staging_folder,
)

MAKER = "dlo quantize"


class QuantizeError(FolderError):
    """Input `dlo quantize` refuses: the message names the argument and what to do."""


def quantize_folder(src: Path, dst: Path, *, show_progress: bool = True) -> dict:
    """SRC's pipeline with its transformers' linear weights in FP8, at DST (module docstring)."""
    src, dst = src.resolve(), dst.resolve()
    check_paths(src, dst)
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
    partial = staging_folder(dst)
    check_free(dst, need, "the FP8 transformers")
    claim(partial, MAKER, src=str(src))  # a killed run's is removed: there is nothing to resume
    try:
        bar = progress_bar(sum(c.nbytes for c in ckpts.values()), show_progress, "quantize")
        counts = {name: _write_component(ckpt, src / name, partial / name, bar) for name, ckpt in ckpts.items()}
        bar.close()
        linked = link_rest(src, partial, set(ckpts))
        publish(partial, dst)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)  # made by this run, just above
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
    import torch

    from dlo.engine.dtypes import torch_dtype
    from dlo.engine.quantize import InMemoryFp8
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

    def fill(name: str, shape: tuple[int, ...], dtype: Any) -> Iterable[Any]:
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
            link_or_copy(extra, dst / extra.name)
    return len(chosen)


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
    try:
        summary = quantize_folder(args.src, args.dst, show_progress=not args.no_progress)
    except (FolderError, OSError) as e:
        print(f"dlo quantize: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0
