"""The small-GPU record's runs (issue 27): per model, the runs of its one call in order of value, and
the figures the pipeline record does not have (FP8 drift, the request just beyond the limits, the
plan the server logged).

Owns: `SMALL_GPU_RUNS` (per model: diffusers and `dlo serve` run names, most valuable first: a call
cut short by its budget keeps those), `serve_flags` (each serve run's flags: the default mode under
a cap, zero resident blocks, FP8 streaming from a `dlo quantize` folder), `QUANTIZED` (the marker of a
run served from that folder), `beyond_limits` (a request one step past the limits: it must get a 400
naming the limit), `plan_lines` (the server log's mode, tiling and resident-block arithmetic) and
`image_drift` (max abs and PSNR of two PNGs).
Must never: start a server or write the record (`bench/pipeline.py` does).
"""

from __future__ import annotations

import io
import math
from pathlib import Path

QUANTIZED = "@fp8-folder"  # the run is served from `dlo quantize`'s folder beside the model

# names as in bench/pipeline.py (diffusers_*: the plain-diffusers child; serve_*: `serve_flags`)
SMALL_GPU_RUNS: dict[str, tuple[str, ...]] = {
    # defect 1 (the default mode under a 24 GiB cap), its latency against the uncapped server, against
    # diffusers' group offloading under the same cap; defect 3 (12 GiB, 832x480x17); diffusers resident
    "wan21": ("serve_default_capped_24gib", "diffusers_group_offload_capped_24gib", "serve_default",
              "serve_default_capped_12gib", "diffusers_resident"),
    # auto resident blocks against none, both under 24 GiB (CFG pairs, the default, against none:
    # `_unpaired`); diffusers' group offloading; resident
    "qwen": ("serve_default_capped_24gib", "serve_capped_24gib_zero_resident",
             "serve_capped_24gib_zero_resident_unpaired", "serve_default_capped_24gib_unpaired",
             "diffusers_group_offload_capped_24gib", "diffusers_resident"),
    # FP8 streaming against bfloat16, both with no resident block under 24 GiB; the default under the
    # cap against diffusers' group offloading; resident
    "flux": ("serve_capped_24gib_zero_resident", "serve_capped_24gib_zero_resident_fp8",
             "serve_default_capped_24gib", "diffusers_group_offload_capped_24gib", "diffusers_resident"),
    "wan21i2v": ("serve_default_capped_24gib", "diffusers_group_offload_capped_24gib", "serve_default",
                 "diffusers_resident"),
}
_SERVE: dict[str, tuple[str, ...]] = {
    "serve_default": ("--dp", "1"),
    "serve_default_capped_24gib": ("--dp", "1", "--max-device-memory", "24GiB"),
    "serve_default_capped_12gib": ("--dp", "1", "--max-device-memory", "12GiB"),
    "serve_capped_24gib_zero_resident": ("--dp", "1", "--max-device-memory", "24GiB", "--resident-blocks", "0"),
    "serve_default_capped_24gib_unpaired": ("--dp", "1", "--max-device-memory", "24GiB", "--no-cfg-pairs"),
    "serve_capped_24gib_zero_resident_unpaired": ("--dp", "1", "--max-device-memory", "24GiB", "--resident-blocks",
                                                  "0", "--no-cfg-pairs"),
    "serve_capped_24gib_zero_resident_fp8": ("--dp", "1", "--max-device-memory", "24GiB", "--resident-blocks", "0",
                                             "--stream-dtype", "fp8", QUANTIZED),
}


def serve_flags(name: str, device: str) -> tuple[str, ...]:
    """A small-GPU serve run's flags; on cpu (the dry run) without the cap, which needs an accelerator."""
    flags = _SERVE[name]
    if device == "cuda":
        return flags
    out: list[str] = []
    skip = False
    for f in flags:
        if skip:
            skip = False
            continue
        if f == "--max-device-memory":
            skip = True
            continue
        out.append(f)
    return tuple(out)


def beyond_limits(request: dict, limits: dict) -> tuple[dict, str]:
    """The request one step past the limits (one more latent frame of video, 16 pixels wider for an
    image) and what its 400 must say: the limit it passes (the server names it `limit of ...`)."""
    if limits.get("small"):  # the small limits: 128x128 at most
        return {**request, "size": "144x64"}, "limit of 128x128"
    if request["kind"] == "video":
        return {**request, "frames": limits["max_frames"] + 4}, f"limit of {limits['max_frames']}"
    w, h = map(int, request["size"].split("x"))
    return ({**request, "size": f"{limits['max_width'] + 16}x{h}"},
            f"limit of {limits['max_width']}x{limits['max_height']}")


def refused(error: Exception, limit: str) -> dict:
    """What a refused request says: its HTTP status and whether the message names the limit (`limit`:
    the text `beyond_limits` expects)."""
    status = getattr(error, "status_code", None)
    text = str(getattr(error, "body", None) or error)
    return {"status": status, "names_limit": limit in text, "message": text[:300]}


PLAN_MARKS = ("resident_blocks=auto", "vae tiling above", "serving ", "fits the device budget", "device memory capped")


def plan_lines(log: Path) -> list[str]:
    """The server log's lines that say what the budget decided (mode, tiling, resident blocks)."""
    if not log.exists():
        return []
    return [line.strip()[:600] for line in log.read_text(errors="replace").splitlines()
            if any(m in line for m in PLAN_MARKS)][:12]


def image_drift(reference: bytes, other: bytes) -> dict:
    """Max abs difference (levels of 255) and PSNR (dB, peak 255) of two PNGs; None: identical."""
    import numpy as np
    from PIL import Image

    a = np.asarray(Image.open(io.BytesIO(reference)).convert("RGB"), dtype=np.float64)
    b = np.asarray(Image.open(io.BytesIO(other)).convert("RGB"), dtype=np.float64)
    if a.shape != b.shape:
        return {"error": f"shapes {a.shape} and {b.shape}"}
    mse = float(((a - b) ** 2).mean())
    return {"max_abs_levels": float(np.abs(a - b).max()),
            "psnr_db": None if mse == 0 else round(10 * math.log10(255.0**2 / mse), 2),
            "note": "random weights: a proxy for a real checkpoint's drift"}


def fp8_drift(outputs: dict[str, bytes]) -> dict | None:
    """FP8's output against bfloat16's, both streamed with no resident block, where both ran."""
    a, b = outputs.get("serve_capped_24gib_zero_resident"), outputs.get("serve_capped_24gib_zero_resident_fp8")
    if a is None or b is None:
        return None
    try:
        return image_drift(a, b)
    except Exception as e:  # a video (MP4): no PNG to compare
        return {"error": f"{type(e).__name__}: {e}"[:200]}


def quantized_folder(model: Path) -> Path:
    """Where `dlo quantize` writes the model's FP8 folder (beside it)."""
    return model.with_name(model.name + "-fp8")


def served_folder(flags: tuple[str, ...], model: Path) -> tuple[tuple[str, ...], Path]:
    """The flags without the folder marker, and the folder the run serves."""
    if QUANTIZED not in flags:
        return flags, model
    return tuple(f for f in flags if f != QUANTIZED), quantized_folder(model)
