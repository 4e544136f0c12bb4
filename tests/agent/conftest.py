"""Shared fixtures for the agent tests: torch-free model folders written byte by byte."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """Write a safetensors file of random bytes; `tensors` maps name -> (dtype, shape). Returns its size."""
    sizes = {"BF16": 2, "F32": 4, "F16": 2}
    header: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        f.write(os.urandom(offset))
    return path.stat().st_size


def write_wan_folder(folder: Path, blocks: int = 3, dim: int = 64) -> Path:
    """A pipeline-shaped folder: transformer/ (Wan, `blocks` blocks) and a small vae/."""
    tensors: dict[str, tuple[str, list[int]]] = {"patch_embedding.weight": ("BF16", [dim, 16])}
    for i in range(blocks):
        tensors[f"blocks.{i}.attn1.to_q.weight"] = ("BF16", [dim, dim])
        tensors[f"blocks.{i}.norm2.weight"] = ("F32", [dim])
    t = folder / "transformer"
    t.mkdir(parents=True, exist_ok=True)
    (t / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel", "num_layers": blocks}))
    write_safetensors(t / "diffusion_pytorch_model.safetensors", tensors)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline"}))
    write_safetensors(folder / "vae" / "diffusion_pytorch_model.safetensors", {"w": ("F32", [1024])})
    return folder


@pytest.fixture
def models_root(tmp_path: Path) -> Path:
    """A models root with one Wan pipeline folder `tiny-wan` and one folder that is not a model."""
    root = tmp_path / "models"
    write_wan_folder(root / "tiny-wan")
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "README").write_text("not a model")
    return root
