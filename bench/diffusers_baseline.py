"""Plain diffusers on the same folder: the baselines `dlo serve` is measured against.

Owns: loading a pipeline folder with diffusers alone (`load_pipeline`: everything resident on the
device, or diffusers' group offloading at leaf level with a stream on the transformers and the text
encoders, the VAE and image encoder on the device), one call of it (`pipeline_call`), per-component
peak device memory of a call (`PhasePeaks`), host memory of the process (`bench/host_memory.py`),
and the child process `bench/pipeline.py` runs (`baseline_child`): an optional device-memory cap
(the allocator's, as `dlo serve --max-device-memory` sets it), a warm-up at the request's size,
then the timed repeats.
Must never: import dlo's engine beyond what a user of plain diffusers would do the same way (the
VAE cast `decode_in_own_dtype` is the one shared fix, so the bytes compare).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

PROMPT = "a lighthouse on a cliff at dusk, waves breaking below"
NEGATIVE = "blurry, low quality"
SEED = 42
GROUP_OFFLOADED = ("transformer", "transformer_2", "text_encoder", "text_encoder_2")


def _transformer(folder: Path, device: str) -> Any:
    """A diffusers transformer: its safetensors loaded straight to `device` and assigned to a
    skeleton whose parameters are on meta (buffers computed for real). Without the accelerate
    package `from_pretrained` refuses classes with `_keep_in_fp32_modules`, and a plain
    `from_config` would first allocate 57 GB of float32 for a 14B model."""
    import diffusers
    from safetensors.torch import load_file

    from dlo.engine.meta import parameters_on_meta

    config = json.loads((folder / "config.json").read_text())
    cls = getattr(diffusers, config["_class_name"])
    with parameters_on_meta():
        model = cls.from_config(config)
    state: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(f, device=device))
    model.load_state_dict(state, strict=True, assign=True)  # the stored dtypes: bf16, fp32-kept modules fp32
    return model.to(device).eval()


def load_pipeline(model: Path | str, device: str, placement: str = "resident", *, low_cpu_mem_usage: bool = False) -> Any:
    """The folder's diffusers pipeline, bf16 (VAE float32): `resident` (all on `device`) or
    `group_offload` (leaf level + stream on the transformers and text encoders)."""
    import diffusers
    import torch

    from dlo.serving.pipeline import decode_in_own_dtype

    model = Path(model)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    index = json.loads((model / "model_index.json").read_text())
    where = device if placement == "resident" else "cpu"
    pipe = getattr(diffusers, index["_class_name"]).from_pretrained(
        model, torch_dtype={"default": dtype, "vae": torch.float32},
        **{name: _transformer(model / name, where) for name in ("transformer", "transformer_2")
           if (index.get(name) or [None])[0] is not None})
    if placement == "resident":
        pipe.to(device)
    elif placement == "group_offload":
        keep = [n for n, c in pipe.components.items() if isinstance(c, torch.nn.Module) and n not in GROUP_OFFLOADED]
        pipe.enable_group_offload(onload_device=torch.device(device), offload_device=torch.device("cpu"),
                                  offload_type="leaf_level", use_stream=True, low_cpu_mem_usage=low_cpu_mem_usage,
                                  exclude_modules=keep)
    else:
        raise ValueError(f"unknown placement {placement!r}")
    pipe.set_progress_bar_config(disable=True)
    decode_in_own_dtype(pipe.vae)  # Flux/QwenImage hand a float32 VAE bfloat16 latents (the same cast dlo serve makes)
    return pipe


def enable_cache(pipe: Any, config: dict | None) -> None:
    """diffusers' own step cache on the pipeline's transformer: `config` is {"class": a diffusers cache
    config class, "kwargs": {...}} (`taylor_factors_dtype` by name), written by the caller, never
    read from DLO's presets; None: none."""
    if not config:
        return
    import diffusers
    import torch

    kwargs = dict(config["kwargs"])
    if "taylor_factors_dtype" in kwargs:
        kwargs["taylor_factors_dtype"] = getattr(torch, kwargs["taylor_factors_dtype"])
    pipe.transformer.enable_cache(getattr(diffusers, config["class"])(**kwargs))


def pipeline_call(pipe: Any, facts: Any, shape: Any, *, steps: int, guidance: float | None = None,
                  negative: bool = False, max_sequence_length: int = 512, image: Any = None) -> Any:
    """One call at `shape` (`dlo.plan.memory_model.Shape`), as `dlo serve` would make it."""
    import torch

    g = facts.default_guidance if guidance is None else guidance
    kw: dict[str, Any] = dict(prompt=PROMPT, height=shape.height, width=shape.width, num_inference_steps=steps,
                              output_type="np", generator=torch.Generator("cpu").manual_seed(SEED),
                              max_sequence_length=max_sequence_length)
    if facts.family in ("flux", "qwen-image"):  # true CFG with a negative prompt; Flux keeps its distilled guidance
        kw["true_cfg_scale"] = g if negative else 1.0
        kw["guidance_scale"] = g if facts.family == "flux" else None
        kw["num_images_per_prompt"] = shape.batch
        if negative:
            kw["negative_prompt"] = NEGATIVE
    else:
        kw.update(guidance_scale=g, num_frames=shape.frames, num_videos_per_prompt=shape.batch)
        if negative:
            kw["negative_prompt"] = NEGATIVE
    if facts.image_input:
        from PIL import Image

        kw["image"] = image if image is not None else Image.new("RGB", (shape.width, shape.height), (128, 128, 128))
    return pipe(**kw)


class PhasePeaks:
    """Peak allocated device bytes per component of a pipeline call (forward and VAE decode/encode
    wrapped: each call resets the peak before and reads it after)."""

    def __init__(self, pipe: Any, device: str) -> None:
        import torch

        self.torch, self.device, self.peaks = torch, device, {}
        for name in ("text_encoder", "text_encoder_2", "image_encoder", "transformer", "transformer_2"):
            module = getattr(pipe, name, None)
            if module is not None:
                module.forward = self._wrap(name, module.forward)
        if getattr(pipe, "vae", None) is not None:
            pipe.vae.decode = self._wrap("vae_decode", pipe.vae.decode)
            pipe.vae.encode = self._wrap("vae_encode", pipe.vae.encode)

    def _wrap(self, name: str, fn: Any) -> Any:
        torch = self.torch

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not self.device.startswith("cuda"):
                return fn(*args, **kwargs)
            torch.cuda.reset_peak_memory_stats()
            out = fn(*args, **kwargs)
            self.peaks[name] = max(self.peaks.get(name, 0), torch.cuda.max_memory_allocated())
            return out

        return wrapped


def baseline_child(model: str, request: dict, device: str) -> dict:
    """`placement` (resident | group_offload) under an optional `cap_bytes`, with an optional
    `diffusers_cache` (`enable_cache`): load, warm up at the request's size, then `repeats` timed
    calls (the fastest is `seconds`, encode included)."""
    import numpy as np
    import torch

    from dlo.engine.families import pipeline_facts
    from dlo.plan.memory_model import Shape
    from dlo.serving.encode import encode_mp4, encode_png
    from bench.host_memory import tree_memory

    if request.get("cap_bytes") and device.startswith("cuda"):
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(request["cap_bytes"] / total)
    t0 = time.perf_counter()
    pipe = load_pipeline(model, device, request.get("placement", "resident"),
                         low_cpu_mem_usage=request.get("low_cpu_mem_usage", False))
    load = time.perf_counter() - t0
    enable_cache(pipe, request.get("diffusers_cache"))
    facts = pipeline_facts(model)
    w, h = map(int, request["size"].split("x"))
    shape = Shape(w, h, request.get("frames", 1), 1)

    def call(steps: int) -> Any:
        with torch.inference_mode():
            return pipeline_call(pipe, facts, shape, steps=steps, guidance=request["guidance"],
                                 negative=bool(request.get("negative_prompt")))

    call(2)  # warm-up at the request's size
    peaks = PhasePeaks(pipe, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    timed: list[tuple[float, float]] = []  # (seconds, pipeline seconds) of each repeat
    for _ in range(max(1, request.get("repeats", 1))):  # as many as the server's requests: the fastest of each
        t1 = time.perf_counter()
        out = call(request["steps"])
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        pipeline_seconds = time.perf_counter() - t1
        # Wan's image is a one-frame video: its frame, as the server encodes it
        frames = np.asarray(out.frames if request["kind"] == "video" or not hasattr(out, "images") else out.images)
        first = frames[0] if frames[0].ndim == 3 or request["kind"] == "video" else frames[0][0]
        encoded = encode_mp4(first, 16) if request["kind"] == "video" else encode_png(first)
        timed.append((time.perf_counter() - t1, pipeline_seconds))
        if len(timed) == 1:
            output_sha = hashlib.sha256(encoded).hexdigest()
            if request.get("output_path"):  # the encoded bytes, to compare with the server's answer
                Path(request["output_path"]).write_bytes(encoded)
    seconds, pipeline_seconds = min(timed)
    return {"seconds": round(seconds, 3), "pipeline_seconds": round(pipeline_seconds, 3),
            "request_seconds": [round(t, 3) for t, _ in timed], "encode_seconds": round(seconds - pipeline_seconds, 3),
            "load_seconds": round(load, 2), "placement": request.get("placement", "resident"),
            "cap_bytes": request.get("cap_bytes"),
            "peak_device_bytes": max([torch.cuda.max_memory_allocated(), *peaks.peaks.values()])
            if device.startswith("cuda") else None,
            "component_peak_device_bytes": peaks.peaks, "host_memory": tree_memory(os.getpid(), children=False),
            "frames_sha256": hashlib.sha256(frames.tobytes()).hexdigest(), "output_sha256": output_sha}
