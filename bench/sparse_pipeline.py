"""A full-size pipeline folder without its weights: configs, tokenizers and safetensors headers real,
every file's data a hole (sparse: no disk blocks, zeros when read), for what reads headers only.

Owns: `write_sparse_pipeline` (a preset's folder as `dlo make-random-model` lays it out, in seconds and
a few MB of disk). What it is for: the memory model's and the policy's arithmetic at full size on a
CPU host (`bench/pipeline.py --plan-preview`: the resident blocks, the VAE tiling and the peak
`dlo serve` would choose under a budget), never for running a model (every weight reads as zero).
Must never: be passed to anything that computes with the weights, or count as a result.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Iterable


def write_sparse_pipeline(out: Path, preset_name: str, layers: int | None = None) -> Path:
    """`out` as the preset's pipeline folder, every safetensors file's data section a hole."""
    from dlo.engine import random_model
    from dlo.engine.presets import preset

    if (out / "model_index.json").exists():
        return out

    def no_data(name: str, shape: tuple[int, ...], dtype: Any, *_: Any, **__: Any) -> Iterable[Any]:
        return iter(())

    real = random_model.random_fill
    random_model.random_fill = no_data  # the writer draws every tensor's bytes from it: none written
    try:
        random_model.write_pipeline(out, preset(preset_name, layers), free_bytes=1 << 62)
    finally:
        random_model.random_fill = real
    for f in out.rglob("*.safetensors"):
        _extend_to_header(f)
    return out


def _extend_to_header(path: Path) -> None:
    """Make the file as long as its header says (a hole from the written bytes to the end)."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
        f.truncate(8 + n + end)
