"""The requests `bench/pipeline.py` sends a server: the limits it gives it, the largest request
those accept, and one request through the official openai SDK.

Owns: `server_limits`, `largest_request`, `generate`, `grey_png`.
Must never: start or stop a server (the runner does).
"""

from __future__ import annotations

import base64
import json
from typing import Any

from bench.diffusers_baseline import NEGATIVE, PROMPT, SEED


def server_limits(request: dict, tiny: bool, extra_json: str | None = None) -> dict:
    """The limits of a model's servers: the request is the largest accepted (`extra_json` adds to
    them); the tiny dry run uses `--small-limits`."""
    if tiny:
        return {"small": True}
    w, h = map(int, request["size"].split("x"))
    return {"max_width": w, "max_height": h, "max_frames": request.get("frames", 1), "max_n": 1, "max_steps": 50,
            **json.loads(extra_json or "{}")}


def largest_request(limits: dict, request: dict) -> dict:
    """The largest request `limits` accept, of the request's kind."""
    if limits.get("small"):
        return {**request}
    size = f"{limits['max_width'] // 16 * 16}x{limits['max_height'] // 16 * 16}"
    if request["kind"] == "video":
        return {**request, "size": size, "frames": (limits["max_frames"] - 1) // 4 * 4 + 1}
    return {**request, "size": size, "n": limits["max_n"]}


def generate(client: Any, request: dict) -> bytes:
    """One request through the official SDK: the returned PNG or MP4 bytes."""
    return answer(client, request)[0]


def answer(client: Any, request: dict) -> tuple[bytes, dict[str, Any]]:
    """One request through the official SDK: the PNG or MP4 bytes, and what the server said of it
    beside them (an image's `X-DLO-VAE-Tiled` and `Server-Timing` headers; a video job's `vae_tiled`
    and `timings` fields)."""
    body: dict[str, Any] = {"seed": SEED, "num_inference_steps": request["steps"], "guidance_scale": request["guidance"]}
    if request.get("lora"):  # a LoRA adapter of the server's --lora-dir (bench/lora.py)
        body["lora"] = request["lora"]
    if request.get("negative_prompt"):
        body["negative_prompt"] = NEGATIVE
    if request.get("cache") is not None:  # a step cache (bench/step_cache.py): a preset and its parameters
        body["cache"] = request["cache"]
    if request["kind"] == "video":
        extra: dict[str, Any] = {}
        if request.get("image"):
            extra["input_reference"] = ("first.png", request["image"], "image/png")
        job = client.videos.create_and_poll(prompt=PROMPT, size=request["size"], poll_interval_ms=50,
                                            extra_body={**body, "num_frames": request["frames"]}, **extra)
        if job.status != "completed":
            raise RuntimeError(f"video failed: {job.error}")
        said = job.model_extra or {}  # the server's extensions to OpenAI's video object
        return client.videos.download_content(job.id).read(), {k: said.get(k) for k in ("vae_tiled", "timings")}
    raw = client.images.with_raw_response.generate(prompt=PROMPT, size=request["size"], response_format="b64_json",
                                                   n=request.get("n", 1), extra_body=body)
    said = {k: raw.headers.get(k, "") for k in ("X-DLO-VAE-Tiled", "Server-Timing")}
    return base64.b64decode(raw.parse().data[0].b64_json or ""), said


def grey_png(size: str) -> bytes:
    """A mid-grey first frame (image-to-video), as the diffusers baseline and the warm-up use."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", tuple(map(int, size.split("x"))), (128, 128, 128)).save(buf, format="PNG")  # type: ignore[arg-type]
    return buf.getvalue()
