"""The model folders the GPU benchmarks run on: written, quantized and read into the page cache.

Owns: `make` (`dlo make-random-model` in a child process, skipped when the folder is there),
`quantize` (`dlo quantize --dtype fp8` beside it, `bench/small_gpu.py`'s FP8 runs), `warm_page_cache`
and `checkpoint_bytes`. Used by `bench/pipeline.py` and `bench/memory.py`.
Must never: delete a folder (the runners decide when).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from bench.small_gpu import quantized_folder


def checkpoint_bytes(model: Path) -> int:
    return sum(p.stat().st_size for p in model.rglob("*.safetensors"))


def warm_page_cache(model: Path) -> float:
    t0 = time.perf_counter()
    for p in sorted(model.rglob("*.safetensors")):
        with open(p, "rb") as f:
            while f.read(1 << 26):
                pass
    return time.perf_counter() - t0


def make(model: Path, preset: str, layers: int | None, device: str) -> dict:
    if (model / "model_index.json").exists():
        return {"skipped": "present", "bytes": checkpoint_bytes(model)}
    return _dlo("make-random-model", str(model), "--preset", preset, "--device", device, "--no-progress",
                *(["--layers", str(layers)] if layers else []))


def quantize(model: Path) -> dict:
    """`dlo quantize` of the model's folder beside it (skipped if present): seconds and bytes."""
    dst = quantized_folder(model)
    if (dst / "model_index.json").exists():
        return {"skipped": "present"}
    return _dlo("quantize", str(model), str(dst), "--dtype", "fp8", "--no-progress")


def _dlo(*argv: str) -> dict:
    """One `dlo` subcommand in a child process: its command, seconds and JSON summary."""
    cmd = [sys.executable, "-m", "dlo.cli.main", *argv]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"dlo {argv[0]} failed: {r.stderr[-2000:]}")
    return {"command": " ".join(cmd[1:]), "seconds": round(time.perf_counter() - t0, 2), **json.loads(r.stdout)}
