"""`dlo fuse-lora MODEL ADAPTER[:SCALE] DST`: MODEL with a LoRA adapter merged into its weights.

DST serves the adapter with no per-request cost from one page-cache copy (a distilled few-step
adapter: `guidance_scale` 1, 4 steps).

Owns: the subcommand (`add_arguments`, `main`), `parse_adapter` (`ADAPTER[:SCALE]`: a `--lora-dir`
entry, a `NAME.safetensors` file or a `NAME/` folder, and a finite scale, 1 by default), `fuse_folder`
and `run_facts` (what a resumed run must share with the killed one). The adapter is checked against
the model by the start check of `dlo serve` (`dlo.engine.lora.check_adapters`) and read as serving
reads it (`dlo.engine.lora.weights.read_adapter`); the transformer is streamed tensor by tensor from
its files (page-cache views, `dlo.engine.checkpoint`), each targeted weight and lora bias merged in
the dtype the served model computes it in with `dlo.engine.lora.merge.merge_weight` / `merge_bias`:
peft's two steps at scaling x SCALE, the bytes `dlo serve --lora-apply merge` computes with on the
same kind of device (`--device`; peft merges a half-precision delta in float32 on cpu only) and
diffusers' `fuse_lora(lora_scale=SCALE)` gives. The transformer's files keep their names, tensors,
dtypes and index (a merged tensor of a module the class keeps in float32 but the folder stores in
half precision is written in float32, as diffusers holds it; the index's total_size follows); every
other file is hard-linked (copied across filesystems). Staged in a marked `DST.partial`
and renamed when complete (`dlo.engine.staged_folder`); each shard is written under a temporary
name and renamed into `DST.partial` when whole, so a killed run's `DST.partial` (its process gone,
the same `run_facts`) is taken over and its whole shards kept; one with other facts is removed.
Must never: write into or delete MODEL or the adapter, delete a folder it did not make, leave a
half-written DST, hold more of the transformer in memory than one weight and its merge, import peft,
or import torch before the arguments, MODEL's headers and the adapter's check are done (a bad
argument is a one-line exit 2 at once).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dlo.delivery.owned import remove_marked
from dlo.engine.staged_folder import (
    FolderError,
    check_free,
    check_paths,
    claim,
    link_rest,
    progress_bar,
    publish,
    staging_folder,
)

MAKER = "dlo fuse-lora"
COMPONENT = "transformer"  # what an adapter's `transformer.` keys name (dlo.engine.lora.adapters.PREFIX)
WRITING = ".dlo-writing"  # inside DST.partial: a shard being written, renamed into place when whole
_FLOATS = ("F16", "BF16", "F32", "F64")


class FuseError(FolderError):
    """Input `dlo fuse-lora` refuses: the message names the argument and what to do."""


def parse_adapter(text: str) -> tuple[Path, float]:
    """`ADAPTER[:SCALE]` as (adapter path, scale): a path that exists is taken whole (scale 1), else the
    text after the last ':' is the scale; argparse's one-line error for anything else."""
    path = Path(text)
    if path.exists():
        return path, 1.0
    head, sep, tail = text.rpartition(":")
    if sep:
        try:
            scale = float(tail)
        except ValueError:
            scale = math.nan
        if not math.isfinite(scale):
            raise argparse.ArgumentTypeError(f"{text}: SCALE {tail!r} must be a finite number (ADAPTER[:SCALE])")
        if Path(head).exists():
            return Path(head), scale
        text = head
    raise argparse.ArgumentTypeError(f"{text}: no such file or folder")


def check_adapter(adapter: Path, model: Path, pipeline_class: str) -> Any:
    """`adapter` (a weight file or an adapter folder) checked against `model` by `dlo serve`'s start
    check, as the one entry of a `--lora-dir`; its plan, `path` its weight file. FuseError naming it."""
    from dlo.engine.lora import AdapterError, check_adapters

    with tempfile.TemporaryDirectory(prefix="dlo-fuse-lora-") as tmp:
        link = Path(tmp) / ("adapter" if adapter.is_dir() else "adapter.safetensors")
        link.symlink_to(adapter)
        try:
            plans = check_adapters(tmp, model, pipeline_class)
        except AdapterError as e:
            raise FuseError(f"ADAPTER {str(e).replace(str(link), str(adapter))}") from None
    if len(plans) != 1:
        raise FuseError(f"ADAPTER {adapter}: not an adapter file or folder")
    weight_file = adapter / plans[0].path.relative_to(link) if adapter.is_dir() else adapter
    return replace(plans[0], path=weight_file)


def run_facts(src: Path, adapter: Path, scale: float, device: str) -> dict[str, Any]:
    """What this run writes from (resolved MODEL, the adapter's weight file, the scale, the device,
    and the size and time of each transformer and adapter file): a killed run's `DST.partial` is
    resumed only where its marker holds the same."""
    files = sorted(p for p in (src / COMPONENT).iterdir() if p.is_file()) + [adapter]
    stamps = [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
    return {"src": str(src), "adapter": str(adapter), "scale": scale, "device": device, "files": stamps}


def fuse_folder(model: Path, adapter: Path, scale: float, dst: Path, *, device: str = "cpu",
                show_progress: bool = True) -> dict:
    """MODEL's pipeline with `adapter` merged into its transformer at `scale`, at DST (module docstring)."""
    src, dst = model.resolve(), dst.resolve()
    check_paths(src, dst, "MODEL")
    check_paths(adapter.resolve(), dst, "ADAPTER")
    ckpt, pipeline_class = _read_model(src)
    plan = check_adapter(adapter.resolve(), src, pipeline_class)
    facts = run_facts(src, plan.path, scale, device)
    partial = staging_folder(dst)
    have = partial / COMPONENT  # a killed run's whole shards are kept: no room needed for them
    check_free(dst, sum(p.stat().st_size for p in ckpt.files if not (have / p.name).is_file()), "the fused transformer")
    _check_device(device)
    resumed = claim(partial, MAKER, resume=True, **facts)
    try:
        targets = _targets(plan, pipeline_class, ckpt, scale)  # torch from here on
    except FolderError:
        if not resumed:
            remove_marked(partial, MAKER)  # made just above, nothing in it yet
        raise
    bar = progress_bar(ckpt.nbytes, show_progress, "fuse-lora")
    try:
        written, kept = _write_shards(ckpt, partial / COMPONENT, targets, bar, device, resumed)
    finally:
        bar.close()
        ckpt.close()
    shutil.rmtree(partial / WRITING, ignore_errors=True)
    indexes = _write_index(ckpt, partial / COMPONENT, targets)
    linked = link_rest(src, partial, {f"{COMPONENT}/{name}" for name in [p.name for p in ckpt.files] + indexes})
    publish(partial, dst)  # a failure before this leaves DST.partial, marked: the next run resumes it
    merged = sorted(targets)
    return {"path": str(dst), "adapter": str(plan.path), "scale": scale, "device": device,
            "merged_weights": sum(n.endswith(".weight") for n in merged),
            "merged_biases": sum(n.endswith(".bias") for n in merged),
            "written_files": written + len(indexes), "kept_files": kept, "linked": linked}


def _read_model(src: Path) -> tuple[Any, str]:
    """MODEL's transformer checkpoint (headers only) and its pipeline class; FuseError if neither
    reads, or the transformer holds what a merge cannot take (FP8 weights)."""
    from dlo.engine.checkpoint import CheckpointError, cached_checkpoint
    from dlo.engine.families import pipeline_facts
    from dlo.engine.fp8 import stored_weights

    try:
        pipeline_class = pipeline_facts(src).pipeline_class
        ckpt = cached_checkpoint(src / COMPONENT)
    except (CheckpointError, ValueError, KeyError, OSError) as e:
        raise FuseError(f"MODEL {src}: not a pipeline folder dlo can read ({e})") from None
    if stored_weights(ckpt):
        raise FuseError(f"MODEL {src}: its {COMPONENT} holds FP8 weights (dlo quantize); fuse the adapter into the "
                        "folder it was quantized from, then quantize the fused folder")
    return ckpt, pipeline_class


def _check_device(device: str) -> None:
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise FuseError("--device cuda: no CUDA device is visible to this process")


@dataclass(frozen=True)
class Target:
    """One tensor the merge rewrites: a layer's weight or bias, its branch and factor (peft's scaling
    x SCALE; None: 1), and the dtype the served model computes it in, which it is stored in."""

    branch: Any  # dlo.engine.lora.weights.Branch, in the dtype the layer's weight computes in
    factor: Any
    dtype: Any  # torch dtype
    bias: bool  # the layer's bias (merge_bias) rather than its weight (merge_weight)

    def merged(self, stored: Any, device: str) -> Any:
        """The merged tensor, from `stored` (a read-only view of the file), back on the host."""
        import torch

        from dlo.engine.lora.merge import merge_bias, merge_weight

        b = self.branch
        moved = replace(b, A=b.A.to(device), B=b.B.to(device), bias=None if b.bias is None else b.bias.to(device))
        factor = self.factor.to(device) if isinstance(self.factor, torch.Tensor) else self.factor
        base = stored.to(device=device, dtype=self.dtype)  # upcast as loading does (a module kept in float32)
        if self.bias:  # merged in the weight's dtype, as serving's merge scratch holds it
            out = torch.empty(stored.shape, dtype=b.B.dtype, device=device)
            return merge_bias(out, base, moved, factor).to("cpu", self.dtype)
        out = torch.empty(stored.shape, dtype=self.dtype, device=device)
        return merge_weight(out, base, moved, factor).cpu()

    @property
    def nbytes(self) -> int:
        """Bytes of the merged tensor."""
        rows = self.branch.B.shape[0]
        return rows * (1 if self.bias else self.branch.A.shape[1]) * self.dtype.itemsize


def _targets(plan: Any, pipeline_class: str, ckpt: Any, scale: float) -> dict[str, Target]:
    """Every tensor the adapter changes, by checkpoint name: its layers' weights and, with a lora
    bias, their biases, each in the dtype the served model computes it in (the checkpoint's, float32
    for a module the class keeps in float32: `dlo.engine.model`); the branch cast to the weight's."""
    import torch

    from dlo.engine.checkpoint import CheckpointError
    from dlo.engine.dtypes import torch_dtype
    from dlo.engine.lora.adapters import PREFIX, AdapterEntry, AdapterError
    from dlo.engine.lora.weights import Branch, read_adapter
    from dlo.engine.model import build_meta_model

    try:
        computes = build_meta_model(ckpt.root, ckpt).target_dtype
    except CheckpointError as e:
        raise FuseError(f"MODEL {ckpt.root.parent}: {e}") from None
    try:
        raw = read_adapter(AdapterEntry(plan.name, plan.path), pipeline_class, ckpt.tensors)
    except AdapterError as e:
        raise FuseError(f"ADAPTER {e}") from None
    out: dict[str, Target] = {}
    for m in raw.plan.modules:
        weight, bias_name, key = f"{m.module}.weight", f"{m.module}.bias", PREFIX + m.module
        if computes[weight] not in _FLOATS:
            raise FuseError(f"MODEL {ckpt.root}: {weight} is {computes[weight]}, not a float type a merge writes")
        dtype = torch_dtype(computes[weight])
        A = raw.state[f"{key}.lora_A.weight"].to(dtype=dtype, copy=True)
        B = raw.state[f"{key}.lora_B.weight"].to(dtype=dtype, copy=True)
        bias = raw.state.get(f"{key}.lora_B.bias")
        if m.bias and bias_name not in ckpt.tensors:
            raise FuseError(f"ADAPTER {plan.path}: module {m.module} has a lora bias and the layer none (peft "
                            "refuses to merge it)")
        if m.bias:  # peft gives lora_B a bias where the config says lora_bias: zeros where the file has none
            bias = torch.zeros(m.out_features, dtype=dtype) if bias is None else bias.to(dtype=dtype, copy=True)
        scaling = raw.plan.rule.scaling(m.module)
        factor = scaling if scale == 1.0 else scaling * scale  # as `dlo.engine.lora.bank.LoraBank.applied`
        factor = None if isinstance(factor, float) and factor == 1.0 else factor
        branch = Branch(A, B, bias if m.bias else None, scaling)
        out[weight] = Target(branch, factor, dtype, bias=False)
        if m.bias:
            out[bias_name] = Target(branch, factor, torch_dtype(computes[bias_name]), bias=True)
    return out


def _write_shards(ckpt: Any, dst: Path, targets: dict[str, Target], bar: Any, device: str,
                  resumed: bool) -> tuple[int, int]:
    """Each file of the transformer at `dst` under its own name with the same tensors, the targets
    merged; a resumed run keeps each file already whole. (files written, files kept)"""
    from dlo.engine.checkpoint import read_header
    from dlo.engine.dtypes import safetensors_name, torch_dtype
    from dlo.engine.random_model import write_safetensors

    dst.mkdir(parents=True, exist_ok=True)
    writing = dst.parent / WRITING
    written = kept = 0
    for path in ckpt.files:
        infos = {n: i for n, i in sorted(ckpt.tensors.items()) if i.path == path}
        specs = [(n, targets[n].dtype if n in targets else torch_dtype(i.dtype), i.shape) for n, i in infos.items()]
        if resumed and _whole(dst / path.name, {n: (safetensors_name(d), shape) for n, d, shape in specs}):
            kept += 1
            bar.update(sum(i.nbytes for i in infos.values()))
            continue

        def fill(name: str, shape: tuple[int, ...], dtype: Any) -> Any:
            stored = ckpt.view(name)
            bar.update(stored.numel() * stored.element_size())
            yield stored if name not in targets else targets[name].merged(stored, device)

        shutil.rmtree(writing, ignore_errors=True)
        write_safetensors(writing, specs, stem=path.name.removesuffix(".safetensors"), fill=fill,
                          metadata=read_header(path)[1])
        (writing / path.name).replace(dst / path.name)
        ckpt.close()  # the file's pages leave this process's mappings
        written += 1
    return written, kept


def _write_index(ckpt: Any, dst: Path, targets: dict[str, Target]) -> list[str]:
    """The transformer's index written anew where a merged tensor changed dtype (its total_size);
    the names written (an unchanged index is linked with the rest)."""
    from dlo.engine.checkpoint import INDEX_SUFFIX

    grown = sum(t.nbytes - ckpt.tensors[n].nbytes for n, t in targets.items())
    indexes = sorted(Path(ckpt.root).glob("*" + INDEX_SUFFIX))
    if not grown or not indexes:
        return []
    index = json.loads(indexes[0].read_text())
    if isinstance(index.get("metadata", {}).get("total_size"), int):
        index["metadata"]["total_size"] += grown
    (dst / indexes[0].name).write_text(json.dumps(index, indent=2))
    return [indexes[0].name]


def _whole(path: Path, expected: dict[str, tuple[str, tuple[int, ...]]]) -> bool:
    """Whether `path` (a resumed run's shard) holds exactly the `expected` tensors (safetensors dtype,
    shape), its size their data's end."""
    from dlo.engine.checkpoint import CheckpointError, read_header

    if not path.is_file() or path.is_symlink():
        return False
    try:
        found = read_header(path)[0]
    except CheckpointError:
        return False
    same = {n: (i.dtype, i.shape) for n, i in found.items()} == expected
    return same and path.stat().st_size == max((i.end for i in found.values()), default=0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from dlo.cli.args import existing_dir, new_folder

    parser.add_argument("model", type=existing_dir, metavar="MODEL",
                        help="a diffusers pipeline folder (model_index.json, transformer/, ...)")
    parser.add_argument("adapter", type=parse_adapter, metavar="ADAPTER[:SCALE]",
                        help="a LoRA adapter as `dlo serve --lora-dir` takes one (NAME.safetensors, or a NAME/ "
                             "folder holding pytorch_lora_weights.safetensors), and the scale it is merged at (a "
                             "request's lora_scale; default 1): ADAPTER:0.8")
    parser.add_argument("dst", type=new_folder, metavar="DST",
                        help="the folder to write (new or empty): MODEL with the adapter merged into its "
                             "transformer; every other file hard-linked from MODEL where the filesystem allows, "
                             "else copied. Serve it with `dlo serve DST` (no --lora-dir)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where each weight is merged: the bytes equal `dlo serve --lora-apply merge` and "
                             "diffusers' fuse_lora on that kind of device (peft merges a bfloat16 or float16 "
                             "delta in float32 on cpu, in the weight's dtype on cuda)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (none unless stderr is a terminal)")


def main(args: argparse.Namespace) -> int:
    adapter, scale = args.adapter
    try:
        summary = fuse_folder(args.model, adapter, scale, args.dst, device=args.device,
                              show_progress=not args.no_progress and sys.stderr.isatty())
    except (FolderError, OSError) as e:
        print(f"dlo fuse-lora: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0
