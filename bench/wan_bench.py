"""Shared pieces of the GPU benchmarks: imports without install, a Wan2.1-14B-shaped checkpoint
written from a seeded generator, the two workloads, timers and host-memory readers.

Runs on the device machine (torch present, diffusers carried as a wheel) and on CPU for dry runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent


def top_level_packages() -> dict[str, str]:
    """`dlo.X` -> its folder, as pyproject.toml's package-dir maps them (every part the shim links)."""
    import tomllib

    dirs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name.split(".")[1]: folder for name, folder in dirs.items() if name.count(".") == 1}


def ensure_dlo_importable() -> None:
    """Make `dlo.engine` importable from a plain checkout (the device machine installs nothing)."""
    try:
        import dlo.engine  # noqa: F401

        return
    except ImportError:
        pass
    shim = Path(tempfile.gettempdir()) / "dlo_shim"
    (shim / "dlo").mkdir(parents=True, exist_ok=True)
    for part, folder in top_level_packages().items():
        link = shim / "dlo" / part
        if not link.exists():
            link.symlink_to(REPO / folder)
    sys.path.insert(0, str(shim))
    os.environ["PYTHONPATH"] = f"{shim}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"


# Wan2.1-14B transformer dimensions; only the layer count varies.
WAN14B = {
    "_class_name": "WanTransformer3DModel",
    "patch_size": [1, 2, 2],
    "num_attention_heads": 40,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 13824,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}
TINY = {**WAN14B, "num_attention_heads": 2, "attention_head_dim": 16, "text_dim": 32, "freq_dim": 32, "ffn_dim": 64}

WORKLOADS = {
    # (latent shape, text tokens): image-like 4,096 tokens and 480p video 32,760 tokens
    "image": ((1, 16, 1, 128, 128), 512),
    "video": ((1, 16, 21, 60, 104), 512),
}
TINY_WORKLOADS = {"image": ((1, 16, 1, 16, 16), 8), "video": ((1, 16, 3, 16, 16), 8)}


def write_wan_checkpoint(out: Path, layers: int, device: str, tiny: bool = False, blocks_per_file: int = 5, seed: int = 0) -> dict:
    """Random bf16 weights (fp32 for the class's fp32-kept modules), sharded like real checkpoints."""
    import diffusers
    import torch

    from dlo.engine.meta import parameters_on_meta

    config = {**(TINY if tiny else WAN14B), "num_layers": layers}
    with parameters_on_meta():
        model = diffusers.WanTransformer3DModel.from_config(config)
    keep = set(diffusers.WanTransformer3DModel._keep_in_fp32_modules)
    names = model.state_dict(keep_vars=True)
    from dlo.engine.random_model import random_fill, write_safetensors

    gen = torch.Generator(device).manual_seed(seed)
    t0 = time.perf_counter()
    # One file per `blocks_per_file` blocks (non-block tensors in the first), streamed tensor by
    # tensor by the engine's writer: no second in-memory copy of a multi-GB shard.
    files: dict[int, list] = {}
    for name, t in names.items():
        parts = name.split(".")
        idx = int(parts[1]) // blocks_per_file + 1 if parts[0] == "blocks" else 0
        dtype = torch.float32 if keep.intersection(parts) else torch.bfloat16
        files.setdefault(idx, []).append((name, dtype, tuple(t.shape)))
    specs = [s for _, group in sorted(files.items()) for s in group]
    bounds = {sum(len(g) for _, g in sorted(files.items())[: i + 1]) for i in range(len(files))}
    info = write_safetensors(
        out, specs, stem="diffusion_pytorch_model", fill=lambda n, s, d: random_fill(n, s, d, gen, device),
        cut_after=bounds,
    )
    total = info["bytes"]
    (out / "config.json").write_text(json.dumps(config))
    os.sync()
    return {"bytes": total, "files": info["files"], "write_seconds": time.perf_counter() - t0}


def checkpoint_for(ckpt: str | None, layers: int, device: str, tiny: bool = False) -> tuple[Path, dict | None, Any]:
    """The Wan2.1-14B-shaped checkpoint a benchmark run uses - `ckpt`, else /tmp/wan14b-LAYERS -
    written once (on `device`) when missing; returns (path, write figures or None, model facts)."""
    path = Path(ckpt or f"/tmp/wan14b-{layers}{'-tiny' if tiny else ''}")
    written = None
    if not (path / "config.json").exists():
        written = write_wan_checkpoint(path, layers, device, tiny=tiny)
    from dlo.engine.blocks import describe

    return path, written, describe(path)


def make_inputs(workload: str, device: str, tiny: bool = False, seed: int = 1) -> dict:
    import torch

    shape, text = (TINY_WORKLOADS if tiny else WORKLOADS)[workload]
    gen = torch.Generator(device).manual_seed(seed)
    dim = (TINY if tiny else WAN14B)["text_dim"]
    return dict(
        hidden_states=torch.randn(shape, generator=gen, device=device).to(torch.bfloat16),
        timestep=torch.tensor([500], device=device),
        encoder_hidden_states=torch.randn((1, text, dim), generator=gen, device=device).to(torch.bfloat16),
        return_dict=False,
    )


class Timer:
    """Elapsed milliseconds of a region: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: str):
        import torch

        self.cuda = device.startswith("cuda")
        self.torch = torch

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if self.cuda:
            a, b = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b), out
        t0 = time.perf_counter()
        out = fn()
        return (time.perf_counter() - t0) * 1e3, out


def median_ms(timer: Timer, fn: Callable[[], Any], warmup: int, iters: int) -> tuple[float, list[float], Any]:
    out = None
    for _ in range(warmup):
        _, out = timer(fn)
    times = []
    for _ in range(iters):
        ms, out = timer(fn)
        times.append(ms)
    return statistics.median(times), times, out


def sha256_of(t) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(__import__("torch").uint8).cpu().numpy().tobytes()).hexdigest()


def compare_outputs(ref, got) -> dict:
    """`got` against the reference output `ref`: bit-identical, else the max abs difference and the
    PSNR over the reference's peak-to-peak range (None when identical: infinite)."""
    import math

    import torch

    if got.shape != ref.shape:
        return {"bit_identical": False, "error": f"shape {tuple(got.shape)} vs {tuple(ref.shape)}"}
    diff = (got.float() - ref.float()).abs()
    mse = float((diff.double() ** 2).mean())
    peak = float(ref.max() - ref.min())
    return {"bit_identical": bool(torch.equal(got, ref)), "max_abs_diff": float(diff.max()),
            "psnr_db": None if mse == 0 else 10 * math.log10(peak * peak / mse)}


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    from dlo.agent.memory import parse_kb_table  # stdlib-only: fine on the device machine

    try:
        return parse_kb_table(Path(f"/proc/{pid}/smaps_rollup").read_text())
    except OSError:
        return {}


def h2d_bandwidth(device: str, nbytes: int = 1 << 30) -> float:
    """Pinned host-to-device bandwidth in bytes/s (median of 5)."""
    import torch

    if not device.startswith("cuda"):
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ms, _, _ = median_ms(Timer(device), lambda: dst.copy_(src, non_blocking=True), 2, 5)
    return nbytes / (ms / 1e3)
