"""Plain diffusers on a Cosmos3 or MiniMax-H3 folder: the reference `dlo serve` is measured and checked against.

Owns: loading the folder as a diffusers user without the accelerate package does (`load`:
`Cosmos3OmniPipeline.from_pretrained` with the transformer built from its config and its
safetensors assigned, `enable_safety_checker=False`; MiniMax-H3's `ModularPipeline` from the
folder, its transformer and fp32-keeping VAEs built the same way, tokenizer, text encoder and
schedulers by its own `load_components`, the Qwen3-VL processor without its torchvision video
half), one call as `dlo serve` makes it (`call`: frames, sound, sample rate, per-step seconds),
the bytes the server would answer for it (`encoded`: the server's own PNG / MP4 encoder and
settings), and the child process `bench/seed_models.py` runs (`child`: load, warm-up, the
timed request with NVML energy, peak device memory). `tests/engine/test_seed_families.py` uses
`load`, `call` and `encoded` as its plain-diffusers reference.
Must never: use the engine's loading or pipeline code (only its encoder, so the bytes compare).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def _model(folder: Path, device: str) -> Any:
    """A diffusers model folder built on meta with its safetensors assigned (the plain-diffusers
    loader of `bench/diffusers_baseline.py`, for any class: transformers and VAEs)."""
    from bench.diffusers_baseline import _transformer

    return _transformer(folder, device)


def family(folder: Path) -> str:
    return "minimax-h3" if (folder / "modular_model_index.json").is_file() else "cosmos3"


def load(folder: Path, device: str) -> Any:
    import diffusers
    import torch

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if family(folder) == "cosmos3":
        pipe = diffusers.Cosmos3OmniPipeline.from_pretrained(
            folder, transformer=_model(folder / "transformer", device), enable_safety_checker=False,
            torch_dtype={"default": dtype, "vae": torch.float32, "sound_tokenizer": torch.float32})
        pipe.to(device)
        pipe.set_progress_bar_config(disable=True)
        return pipe
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor

    class ImageOnlyProcessor(Qwen3VLProcessor):  # Qwen3VLVideoProcessor needs torchvision
        def check_argument_for_proper_class(self, name: str, arg: Any) -> Any:
            return None if arg is None else super().check_argument_for_proper_class(name, arg)

    pipe = diffusers.ModularPipeline.from_pretrained(str(folder))
    pipe.update_components(**{name: _model(folder / name, device) for name in ("transformer", "vae", "audio_vae")})
    pipe.load_components(names=["tokenizer"])
    pipe.update_components(processor=ImageOnlyProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(folder / "processor"), tokenizer=pipe.tokenizer,
        video_processor=None))
    pipe.load_components(names=["text_encoder", "scheduler", "audio_scheduler"], dtype=dtype)
    pipe.text_encoder.to(device)
    return pipe


def call(pipe: Any, folder: Path, req: dict) -> dict:
    """`req`: prompt, seed, width, height, steps, frames (1: an image), guidance (Cosmos3), image (PIL or None)."""
    import numpy as np
    import torch

    gen = torch.Generator("cpu").manual_seed(req["seed"])
    steps: list[float] = []
    last = [time.perf_counter()]

    def tick(*_: Any) -> None:
        now = time.perf_counter()
        steps.append(now - last[0])
        last[0] = now

    extra = {"image": req["image"]} if req.get("image") is not None else {}
    with torch.inference_mode():
        if family(folder) == "cosmos3":
            video = req["frames"] > 1

            def on_step(_p: Any, _i: int, _t: Any, kw: dict) -> dict:
                tick()
                return kw

            out = pipe(prompt=req["prompt"], height=req["height"], width=req["width"], num_frames=req["frames"],
                       fps=24.0, num_inference_steps=req["steps"], guidance_scale=req["guidance"], enable_sound=video,
                       generator=gen, output_type="np", enable_safety_check=False, callback_on_step_end=on_step,
                       **extra)
            sound = out.sound.float().cpu().numpy() if video else None
            return {"frames": np.asarray(out.video), "audio": sound, "steps": steps,
                    "sample_rate": int(pipe.sound_tokenizer.config.sampling_rate) if video else 0}
        handle = pipe.transformer.register_forward_hook(lambda *_: tick())
        try:
            out = pipe(prompt=req["prompt"], num_inference_steps=req["steps"], height=req["height"],
                       width=req["width"], num_frames=req["frames"], generator=gen, output_type="np",
                       output=["videos", "audio", "sampling_rate"], **extra)
        finally:
            handle.remove()
        return {"frames": np.asarray(out["videos"])[0], "audio": out["audio"][0].float().cpu().numpy(),
                "sample_rate": int(out["sampling_rate"]), "steps": steps}


def encoded(result: dict) -> bytes:
    """What `dlo serve` answers for these frames: a PNG for one frame, else the MP4 with its sound."""
    from dlo.serving.encode import encode_mp4, encode_png

    if len(result["frames"]) == 1 and result["audio"] is None:
        return encode_png(result["frames"][0])
    return encode_mp4(result["frames"], 24, result["audio"], result["sample_rate"])


def child(folder: str, req: dict, device: str) -> dict:
    """Load, warm up at the request's size (2 steps), then the timed request: seconds (encode
    included), per-step seconds, peak device bytes, NVML joules per GPU over the request, SHA256."""
    import hashlib

    import torch

    from dlo.engine.energy import EnergyMeter

    path = Path(folder)
    if device == "cpu":  # the dry run: CPU reductions follow the thread count; a server rank uses one
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    pipe = load(path, device)
    load_seconds = time.perf_counter() - t0
    call(pipe, path, {**req, "steps": 2})
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    meter = EnergyMeter.all_gpus()
    t1 = time.perf_counter()
    result = call(pipe, path, req)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    pipeline_seconds = time.perf_counter() - t1
    data = encoded(result)
    seconds = time.perf_counter() - t1
    return {"seconds": round(seconds, 3), "pipeline_seconds": round(pipeline_seconds, 3),
            "step_seconds": [round(s, 4) for s in result["steps"]], "load_seconds": round(load_seconds, 2),
            "joules_per_gpu": meter.per_gpu() if meter is not None else None,
            "peak_device_bytes": torch.cuda.max_memory_allocated() if device.startswith("cuda") else None,
            "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


if __name__ == "__main__":  # the child: python -m bench.seed_baseline FOLDER REQUEST_JSON DEVICE
    import sys

    print("RESULT " + json.dumps(child(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])), flush=True)
