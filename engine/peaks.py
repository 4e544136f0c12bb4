"""The decodes and transformer calls a deployment plans with, measured on the device that serves
(`dlo calibrate --peaks`, and `dlo serve`'s first start on an accelerator).

Owns: `library_versions` (what a measurement depends on besides the device and the model: the key
of `dlo.plan.measured`'s cache), `device_name`, `unservable` (a decode no request of which is served:
not measured), and `measure_peaks`: the decodes (the pipeline's VAE loaded as `dlo serve` loads it, float32, whole on the device, each (part, shape)
decoded from an emptied cache with the pipelines' own post-processing to numpy) and the transformer
calls (`dlo.engine.peaks_transformer`), each one's reserved growth (peak reserved less reserved
before: what the phase needed the allocator to hold, fragmentation included) recorded; smallest
first, within a deadline (what is not reached stays the table's).
Must never: measure on a device other than the one named, keep the VAE after it returns, or record
a decode that failed for another reason than memory (an out-of-memory call is recorded as `AtLeast`
the device's whole memory: it does not fit; a shape covering it is not run, it is recorded so;
nor is a decode at a shape whose transformer call did not fit: no request of it is served).
"""

from __future__ import annotations

import gc
import logging
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Mapping

from dlo.plan.memory_model import Shape, decoded_pixels
from dlo.plan.peak_values import AtLeast, measured_bound

log = logging.getLogger(__name__)

VERSIONED = ("torch", "diffusers")


def library_versions() -> str:
    """The libraries whose kernels and allocator a measurement depends on (read without importing them)."""
    out = []
    for name in VERSIONED:
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} none")
    return " ".join(out)


def device_name(device: Any) -> str:
    import torch

    return torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else str(device)


def measurable(model_dir: Path, points: list[tuple[str, Shape]]) -> list[tuple[str, Shape]]:
    """The points `measure_peaks` can measure for this pipeline (its family's transformer calls
    only where `dlo.engine.peaks_transformer` knows how the pipeline calls it)."""
    from dlo.engine.peaks_transformer import MEASURED_FAMILIES

    if _facts(model_dir).family in MEASURED_FAMILIES:
        return points
    return [p for p in points if p[0] != "transformer"]


def measure_peaks(model_dir: Path, points: list[tuple[str, Shape]], device: Any, deadline_s: float,
                  text_len: int, known: Mapping[tuple[str, Shape], int] | None = None
                  ) -> tuple[dict[tuple[str, Shape], int], float]:
    """(reserved growth per (part, shape) measured within `deadline_s`, seconds taken): smallest
    first, decodes and transformer calls (`dlo.engine.peaks_transformer`, at `text_len` text tokens)
    alike, so a deadline leaves the largest shapes of both to the table. A shape covering one that ran
    out of memory (here or in `known`, `dlo.plan.peak_values.measured_bound`) is not run: `AtLeast`."""
    known = known or {}
    import torch

    from dlo.engine.peaks_transformer import transformer_call

    t0 = time.monotonic()
    vae, facts = _load_vae(model_dir, device)
    calls = {"transformer": transformer_call(model_dir, facts, text_len, device) if any(
        p == "transformer" for p, _ in points) else None}
    out: dict[tuple[str, Shape], int] = {}
    try:
        for part, shape in sorted(points, key=lambda p: (decoded_pixels(p[1]), p[0])):
            if time.monotonic() - t0 > deadline_s:
                log.warning("peaks: the deadline of %.0f s passed before %s at %s (the table's figure stands)",
                            deadline_s, part, shape)
                break
            so_far = {**known, **out}
            if isinstance(bound := measured_bound(part, shape, so_far), AtLeast):
                out[(part, shape)] = bound  # it covers a shape that ran out of memory: not run
                log.info("peaks: %s at %s: not run, it covers a shape that ran out of memory", part, shape)
                continue
            if unservable(part, shape, so_far):  # left to the table: no plan serves this shape
                log.info("peaks: %s at %s: not run, its transformer call does not fit", part, shape)
                continue
            call = _call_for(part, calls, vae, facts, device)
            if call is None:  # a transformer this family's inputs are not known for: the table's stands
                continue
            out[(part, shape)] = got = _one(torch, lambda c=call, s=shape: c(s), device)
            log.info("peaks: %s at %s: %s", part, shape, f"out of memory ({got / 1e9:.2f} GB)"
                     if isinstance(got, AtLeast) else f"{got / 1e9:.2f} GB reserved")
    finally:
        del vae, calls
        if torch.cuda.is_available():
            _settle(torch, device)
    return out, time.monotonic() - t0


def unservable(part: str, shape: Shape, points: Mapping[tuple[str, Shape], int]) -> bool:
    """Whether a decode at `shape` need not be measured: the transformer call of a shape it covers
    ran out of memory, so no request of it is served in any mode."""
    return part != "transformer" and isinstance(measured_bound("transformer", shape, points), AtLeast)


def _call_for(part: str, calls: dict[str, Any], vae: Any, facts: Any, device: Any) -> Any:
    """What one measurement of `part` calls with a shape: the transformer's call, or the decode."""
    if part == "transformer":
        return calls["transformer"]
    tiled = part.endswith("_tiled")
    return lambda shape: decode_random(vae, facts, shape, device, tiled=tiled)


def _facts(model_dir: Path) -> Any:
    from dlo.engine.families import pipeline_facts

    return pipeline_facts(model_dir)


def _load_vae(model_dir: Path, device: Any) -> tuple[Any, Any]:
    import diffusers
    import torch

    from dlo.engine.checkpoint import read_json_config
    from dlo.engine.families import pipeline_index

    _, cls = read_json_config(pipeline_index(model_dir))["vae"]
    vae = getattr(diffusers, cls).from_pretrained(model_dir / "vae", torch_dtype=torch.float32)
    return vae.to(device).eval(), _facts(model_dir)


def _one(torch: Any, fn: Any, device: Any) -> int:
    """One call of `fn` from an emptied cache: its reserved growth, or `AtLeast` the device's memory
    when it does not fit. What an earlier call left (an out-of-memory error's frames hold its tensors
    in a reference cycle) is collected first, so it is neither counted nor reused."""
    _settle(torch, device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_reserved(device)
    try:
        with torch.inference_mode():
            out = fn()
            torch.cuda.synchronize(device)
            del out
    except torch.cuda.OutOfMemoryError:
        got: int = AtLeast(total_memory(device))
    else:
        got = torch.cuda.max_memory_reserved(device) - before
    return got  # what it left is collected by the next call's settle, or `measure_peaks`' end


def _settle(torch: Any, device: Any) -> None:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def total_memory(device: Any) -> int:
    import torch

    return torch.cuda.get_device_properties(device).total_memory


def decode_random(vae: Any, facts: Any, shape: Shape, device: Any, *, tiled: bool) -> Any:
    """The pipeline's decode of random latents of `shape` (tiled or plain), and its post-processing to
    numpy: what a request's decode does, shared with the table's calibration (bench/memory_probe.py)."""
    import torch
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.video_processor import VideoProcessor

    vae.enable_tiling() if tiled else vae.disable_tiling()
    cfg = vae.config
    channels = cfg.get("z_dim") or cfg.get("latent_channels")
    scale = 2 ** len(cfg["temperal_downsample"]) if "temperal_downsample" in cfg else 2 ** (
        len(cfg["block_out_channels"]) - 1)
    size = (shape.batch, channels, shape.height // scale, shape.width // scale)
    if "temperal_downsample" in cfg:  # a video VAE (Wan; Qwen-Image decodes one frame of it)
        t = facts.temporal_factor
        frames = (shape.frames - 1) // t + 1 if t else 1
        latents = torch.randn(size[0], size[1], frames, *size[2:], device=device)
    else:
        latents = torch.randn(*size, device=device)
    out = vae.decode(latents, return_dict=False)[0]
    if facts.temporal_factor:
        return VideoProcessor(vae_scale_factor=scale).postprocess_video(out, output_type="np")
    if out.ndim == 5:
        out = out[:, :, 0]
    return VaeImageProcessor(vae_scale_factor=scale).postprocess(out, output_type="np")
