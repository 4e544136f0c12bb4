"""Write a full-size diffusers pipeline folder with seeded random weights (`dlo make-random-model`).

`dlo make-random-model OUT --preset NAME [--layers N] [--device cuda|cpu] [--seed S]` writes
model_index.json, every model component (config.json + safetensors, sharded with an index where the
published model is), the generated tokenizer(s), the scheduler and, for image-to-video, the image
processor, from `dlo.engine.presets`. Real shapes, classes and dtypes; random values.

Weights are streamed tensor by tensor (`write_safetensors`): the model is built on the meta device,
each tensor is drawn on `--device` (cuda: on the GPU; the host only copies and writes), copied to
the host and appended to its file; no shard is ever held in memory whole. The size is printed before anything
is written, and the command refuses when the disk lacks room.

Tokenizers: a byte-level BPE tokenizer without merges (the `tokenizers` library), padded with
unused entries to the real vocabulary size, with the real special tokens at their real ids and the
real maximum length: every prompt tokenizes (ids of its bytes fall in 4..259 or next to the
specials), the embedding tables have their real size, and the padded length is the real one.

Owns: the streamed safetensors writer (also used by `bench/`), random initialisation, the
tokenizer generator, the `make-random-model` subcommand.
Must never: download anything, or hold more than one tensor (in chunks) in memory at a time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from dlo.cli.args import new_folder, positive_int
from dlo.engine.presets import PRESETS, preset
from dlo.engine.presets_base import Component, Preset, TokenizerSpec

log = logging.getLogger(__name__)

GIB = 1 << 30
CHUNK_ELEMENTS = 1 << 26  # largest piece drawn at once (256 MiB of float32)
HEADROOM_BYTES = 1 * GIB  # free space kept beyond the estimate


# ---- the streamed writer ------------------------------------------------------------------------
def random_fill(name: str, shape: tuple[int, ...], dtype: Any, gen: Any, device: str) -> Iterable[Any]:
    """Host tensors (row chunks, in order) of one random tensor: scale 1/sqrt(fan_in) for matrices,
    norm scales near 1, small biases. Drawn on `device`, in float32, then cast."""
    import torch

    fan_in = 1
    for d in shape[1:]:
        fan_in *= d
    rows = shape[0] if shape else 1
    per_row = max(1, fan_in)
    step = max(1, CHUNK_ELEMENTS // per_row)
    for r0 in range(0, rows, step):
        sub = (min(step, rows - r0), *shape[1:]) if shape else ()
        x = torch.randn(sub, generator=gen, device=device, dtype=torch.float32)
        if len(shape) <= 1:
            x = 1.0 + 0.1 * x if name.endswith("weight") or name.endswith("scale") else 0.02 * x
        else:
            x = x * (1.0 / fan_in) ** 0.5
        yield x.to(dtype).cpu().contiguous()


def write_safetensors(
    out: Path,
    tensors: list[tuple[str, Any, tuple[int, ...]]],
    *,
    stem: str,
    fill: Callable[[str, tuple[int, ...], Any], Iterable[Any]],
    max_shard_bytes: int | None = None,
    cut_after: set[int] | None = None,
    progress: Callable[[int], None] = lambda n: None,
    metadata: dict[str, str] | None = None,
) -> dict:
    """Write `(name, torch dtype, shape)` tensors as safetensors files `stem[-0000i-of-0000n].safetensors`
    (plus `stem.safetensors.index.json` when sharded), drawing each tensor's bytes from `fill`.

    Files are cut in the given order, at `max_shard_bytes` or after the tensor counts in `cut_after`
    (a block's tensors stay in one file when the caller cuts at blocks); inside a file tensors are
    laid out as safetensors orders them (dtype size descending, then name); `metadata` joins each
    file's `__metadata__`. Returns bytes and files."""
    import torch

    from dlo.engine.dtypes import safetensors_name

    def nbytes(dtype: Any, shape: tuple[int, ...]) -> int:
        n = dtype.itemsize
        for d in shape:
            n *= d
        return n

    groups: list[list[tuple[str, Any, tuple[int, ...]]]] = [[]]
    size = 0
    for count, spec in enumerate(tensors):
        n = nbytes(spec[1], spec[2])
        if groups[-1] and ((max_shard_bytes and size + n > max_shard_bytes) or (cut_after and count in cut_after)):
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += n
    out.mkdir(parents=True, exist_ok=True)
    sharded = len(groups) > 1
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups):
        fname = f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors" if sharded else f"{stem}.safetensors"
        specs = sorted(group, key=lambda s: (-s[1].itemsize, s[0]))
        header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        offset = 0
        for name, dtype, shape in specs:
            n = nbytes(dtype, shape)
            header[name] = {"dtype": safetensors_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(out / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for name, dtype, shape in specs:
                for host in fill(name, shape, dtype):
                    assert host.dtype == dtype
                    f.write(memoryview(host.view(torch.uint8).reshape(-1).numpy()))
                    progress(host.numel() * host.element_size())
                weight_map[name] = fname
                total += nbytes(dtype, shape)
    if sharded:
        (out / f"{stem}.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
        )
    return {"bytes": total, "files": len(groups)}


# ---- components ---------------------------------------------------------------------------------
def build_on_meta(c: Component) -> Any:
    """The component's module with every parameter on `meta` (buffers real)."""
    import diffusers
    import transformers

    from dlo.engine.meta import parameters_on_meta

    with parameters_on_meta():
        if c.library == "diffusers":
            return getattr(diffusers, c.class_name).from_config(c.config)
        cls = getattr(transformers, c.class_name)
        return cls(cls.config_class(**c.config))


def tensor_specs(c: Component, module: Any) -> list[tuple[str, Any, tuple[int, ...], Any]]:
    """`(name, stored dtype, shape, real value or None)` of every tensor save_pretrained would write,
    in module order (tied parameters once, under their first name)."""
    import torch

    keep = set(getattr(type(module), "_keep_in_fp32_modules", None) or []) if c.library == "diffusers" else set()
    target = getattr(torch, c.dtype)
    seen: set[int] = set()
    specs = []
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue
        seen.add(id(t))
        dtype = t.dtype
        if dtype.is_floating_point:
            dtype = torch.float32 if keep.intersection(name.split(".")) else target
        value = None if t.device.type == "meta" else t.detach()
        specs.append((name, dtype, tuple(t.shape), value))
    return specs


def write_config(c: Component, module: Any, path: Path) -> None:
    import diffusers

    path.mkdir(parents=True, exist_ok=True)
    if c.library == "diffusers":
        module.save_config(path)
        return
    config = module.config
    config.architectures = [c.class_name]
    config.dtype = c.dtype
    config.save_pretrained(path)
    _ = diffusers  # noqa: F841 (both libraries are needed by a pipeline folder)


# ---- tokenizers ---------------------------------------------------------------------------------
def make_tokenizer(spec: TokenizerSpec) -> Any:
    """A `PreTrainedTokenizerFast` over single bytes (no merges) with the spec's vocabulary size,
    special ids and maximum length; unused ids are filled with `<unused_k>` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    by_id: dict[int, str] = {i: tok for tok, i in spec.specials.items()}
    free = (i for i in range(spec.vocab_size) if i not in by_id)
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        by_id[next(free)] = ch
    for k, i in enumerate(free):
        by_id[i] = f"<unused_{k}>"
    vocab = {tok: i for i, tok in by_id.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=spec.unk))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(spec.specials))
    single = "$A"
    pieces = []
    if spec.prepend_bos and spec.bos:
        single = f"{spec.bos} {single}"
        pieces.append((spec.bos, vocab[spec.bos]))
    if spec.append_eos and spec.eos:
        single = f"{single} {spec.eos}"
        pieces.append((spec.eos, vocab[spec.eos]))
    if pieces:
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=pieces)
    kwargs = {k: v for k, v in (("pad_token", spec.pad), ("eos_token", spec.eos), ("bos_token", spec.bos),
                                ("unk_token", spec.unk)) if v is not None}
    if spec.chat_template is not None:
        kwargs["chat_template"] = spec.chat_template
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=spec.model_max_length, **kwargs)


# ---- the pipeline folder ------------------------------------------------------------------------
def estimate(p: Preset) -> dict[str, int]:
    """Bytes per component (from shapes on the meta device; nothing is written)."""
    sizes = {}
    for c in p.components:
        module = build_on_meta(c)
        sizes[c.name] = sum(_nbytes(d, s) for _, d, s, _ in tensor_specs(c, module))
    return sizes


def _nbytes(dtype: Any, shape: tuple[int, ...]) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def write_pipeline(out: Path, p: Preset, *, device: str = "cpu", seed: int = 0, show_progress: bool = False,
                   free_bytes: int | None = None) -> dict:
    """Write the whole pipeline folder; returns a summary (bytes per component, seconds).
    Raises `OSError` when the disk lacks room for it (nothing written then)."""
    import torch

    t0 = time.perf_counter()
    modules = {c.name: build_on_meta(c) for c in p.components}
    specs = {c.name: tensor_specs(c, modules[c.name]) for c in p.components}
    sizes = {name: sum(_nbytes(d, s) for _, d, s, _ in sp) for name, sp in specs.items()}
    total = sum(sizes.values())
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free if free_bytes is None else free_bytes
    print(f"{p.name}: {total / GIB:.2f} GiB to write into {out} "
          f"({', '.join(f'{k} {v / GIB:.2f} GiB' for k, v in sizes.items())}); {free / GIB:.1f} GiB free",
          file=sys.stderr)
    if total + HEADROOM_BYTES > free:
        raise OSError(f"not enough disk space in {out}: the {p.name} pipeline needs {total / GIB:.2f} GiB "
                      f"(+{HEADROOM_BYTES / GIB:.0f} GiB headroom) and {free / GIB:.2f} GiB are free; "
                      f"use --layers to write fewer blocks")
    bar = _progress(total, show_progress)
    files = {}
    for k, c in enumerate(p.components):
        comp_dir = out / c.name
        write_config(c, modules[c.name], comp_dir)
        gen = torch.Generator(device).manual_seed(seed * 1000 + k)

        def fill(name: str, shape: tuple[int, ...], dtype: Any, _values=dict((n, v) for n, _, _, v in specs[c.name]),
                 _gen=gen) -> Iterable[Any]:
            value = _values.get(name)
            if value is not None:  # a real buffer (e.g. a table the constructor computed): its values
                yield value.to(dtype).cpu().contiguous()
                return
            yield from random_fill(name, shape, dtype, _gen, device)

        stem = "diffusion_pytorch_model" if c.library == "diffusers" else "model"
        info = write_safetensors(comp_dir, [(n, d, s) for n, d, s, _ in specs[c.name]], stem=stem, fill=fill,
                                 max_shard_bytes=c.max_shard_bytes, progress=bar)
        files[c.name] = info["files"]
    _write_small_parts(out, p)
    bar(0, close=True)
    if device.startswith("cuda"):
        os.sync()
    return {"path": str(out), "preset": p.name, "bytes": total, "components": sizes, "files": files,
            "seconds": round(time.perf_counter() - t0, 2)}


def _write_small_parts(out: Path, p: Preset) -> None:
    """Tokenizers, schedulers, processors and the pipeline's index (model_index.json, or a modular
    pipeline's modular_model_index.json)."""
    import diffusers

    entries: dict[str, list] = {c.name: [c.library, c.class_name] for c in p.components}
    for t in p.tokenizers:
        make_tokenizer(t).save_pretrained(out / t.name)
        # a modular index names the class the blocks expect (the files load as a fast tokenizer either way)
        entries[t.name] = ["transformers", "Qwen2TokenizerFast" if p.modular_blocks else "PreTrainedTokenizerFast"]
    for folder, (cls_name, config) in [("scheduler", p.scheduler), *((f, (c, cfg)) for f, c, cfg in p.extra_schedulers)]:
        getattr(diffusers, cls_name).from_config(config).save_pretrained(out / folder)
        entries[folder] = ["diffusers", cls_name]
    if p.image_processor is not None:
        from transformers import CLIPImageProcessor

        CLIPImageProcessor(**p.image_processor).save_pretrained(out / "image_processor")
        entries["image_processor"] = ["transformers", "CLIPImageProcessor"]
    if p.processor is not None:
        from transformers import Qwen2VLImageProcessorPil  # the PIL one: no torchvision

        Qwen2VLImageProcessorPil(**p.processor).save_pretrained(out / "processor")
        entries["processor"] = ["transformers", "Qwen3VLProcessor"]
    index: dict[str, Any] = {"_class_name": p.pipeline_class, "_diffusers_version": diffusers.__version__}
    if p.modular_blocks is None:
        index.update(entries)
        index.update(p.index_extras)
        (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
        return
    index["_blocks_class_name"] = p.modular_blocks
    for name, (lib, cls_name) in entries.items():
        index[name] = [lib, cls_name, {"pretrained_model_name_or_path": p.source, "revision": None, "subfolder": name,
                                       "type_hint": [lib, cls_name], "variant": None}]
    index.update(p.index_extras)
    (out / "modular_model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def _progress(total: int, show: bool) -> Callable[..., None]:
    if not show:
        return lambda n, close=False: None
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="writing", file=sys.stderr)

    def update(n: int, close: bool = False) -> None:
        bar.update(n)
        if close:
            bar.close()

    return update


# ---- the subcommand -----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out_dir", type=new_folder, help="folder to write the pipeline into (created; must be new or empty)")
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS),
                        help="the model whose configs, shapes, dtypes and sharding are written; tiny-* presets "
                             "have the same classes and layout with small dimensions (tests)")
    parser.add_argument("--layers", type=positive_int, default=None,
                        help="cap the transformer block count (flux: N double-stream and 2N single-stream blocks) "
                             "AND the layer count of the large text encoder (UMT5/T5 blocks, Qwen2.5-VL and "
                             "Qwen3-VL layers; MiniMax-H3's Qwen3-VL keeps at least the 51 its pipeline reads); "
                             "every other dimension stays real. Default: the published counts")
    parser.add_argument("--device", default="cpu",
                        help="where random values are drawn (cuda: on the GPU; the host only copies and writes)")
    parser.add_argument("--seed", type=int, default=0, help="same seed and device, same bytes")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        p = preset(args.preset, args.layers)
    except (KeyError, ValueError) as e:
        print(f"dlo make-random-model: {e.args[0]}", file=sys.stderr)
        return 2
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("dlo make-random-model: --device cuda but no CUDA device is available", file=sys.stderr)
            return 2
    try:
        summary = write_pipeline(args.out_dir, p, device=args.device, seed=args.seed,
                                 show_progress=not args.no_progress)
    except OSError as e:
        print(f"dlo make-random-model: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0
