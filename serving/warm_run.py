"""The start's warm-up request on a rank, its parts side by side where the family allows it.

Owns: `run_warm_up` (what a rank runs for the warm-up generation, `Generation.warmup`).
Must never: import torch at import time (`rank_main` imports it), change what a
later request computes or returns (the warm-up's output is discarded;
every part of it runs the request path's own functions), or run the decode anywhere but on the
calling thread (the thread every later request of the rank runs on).

[Note: the warm-up's decode beside its denoising]
Libraries keep per-thread state: PyTorch caches cuDNN's execution plans thread-locally
(`threads.WaveThread`), so the VAE's plans must be built on the thread later requests decode on,
while the text encoders' and the transformer's first-call costs (their kernels' loading, cuBLAS'
set-up) are the process's. So where the family can say what its decode is given
(`PipelineFamily.warm_decode`: the VAE at the request's latent shape, with the call's
post-processing), the warm-up runs the pipeline call without its decode (`output_type="latent"`)
on a thread beside, while this thread decodes zeros of that shape and encodes the frames: the
warm-up takes the longer of the two instead of their sum. Measured on one H200 (Wan2.1-14B
resident, 832x480, `ready-h200-2026-12-03-l`): text encoding 0.33-0.56 s, denoising 0.59-0.87 s,
decode 0.64-0.92 s, encoding 0.18-0.24 s, one after another. Both run on the device's default
stream (no ordering between them matters: neither reads what the other writes; a request with an
input image runs whole, as the call beside would encode it with the same VAE, whose causal caches
are the module's own state), and the warm-up's
shape is the smallest or the default one, far below the largest request the budget holds, so both
peaks together fit where that request fits.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from dlo.engine.request import Generation
from dlo.serving.pipeline import RunResult, ServingPipeline


def run_warm_up(pipe: ServingPipeline, gen: Generation) -> RunResult:
    """`pipe.run(gen)`, or its parts side by side where the family has `decode_beside_warmup`
    ([Note: the warm-up's decode beside its denoising]); `phase_seconds` then name the parts:
    `decode`, `encode_output` and `wait` (for the call beside) one after another here, and
    `denoise_beside` (the call without its decode: text encoding and denoising), beside them."""
    if not pipe.adapter.decode_beside_warmup or gen.image is not None:  # an input image: the VAE encodes it beside
        return pipe.run(gen)
    import torch

    t0 = time.perf_counter()
    pipe.set_vae_tiling(gen)
    beside = _Beside(lambda: _denoise_only(pipe, gen))
    try:
        with torch.inference_mode():
            decoded = pipe.adapter.decode(pipe.adapter.warm_decode(pipe.pipe, gen), gen)
        t1 = time.perf_counter()
        outputs, media_type = pipe.encode_output(decoded, gen.fps)
        t2 = time.perf_counter()
    finally:
        beside.wait()  # a failure here never leaves the pipeline in use by the thread beside
    denoise_s = beside.seconds()  # raises what the call beside raised
    pipe.phase = "idle"
    t3 = time.perf_counter()
    return RunResult(outputs, media_type, seconds=t3 - t0,
                     phase_seconds={"decode": t1 - t0, "encode_output": t2 - t1, "wait": t3 - t2,
                                    "denoise_beside": denoise_s})


def _denoise_only(pipe: ServingPipeline, gen: Generation) -> None:
    """The pipeline call of `gen` without its decode (its text encoding, scheduler, denoising)."""
    import torch

    def on_step(_pipe: Any, i: int, _t: Any, kwargs: dict) -> dict:
        pipe.steps_done = i + 1
        pipe.tick()
        return kwargs

    if pipe.device.type == "cuda":  # a new thread starts on device 0: this rank's device, as the caller's
        torch.cuda.set_device(pipe.device)
    pipe.steps_done = 0
    # paired as a request is: CFG pairs' uncond thread makes its plans here too
    with torch.inference_mode(), pipe.pairs.request(pipe.adapter.uses_cfg(gen)):
        pipe.adapter.run(pipe.pipe, {**pipe.pipeline_kwargs(gen), "output_type": "latent"}, on_step)


class _Beside:
    """`fn` on a daemon thread, started now."""

    def __init__(self, fn: Callable[[], None]):
        self._error: BaseException | None = None
        self._seconds = 0.0

        def run() -> None:
            t0 = time.perf_counter()
            try:
                fn()
            except BaseException as e:  # raised again on the caller's thread
                self._error = e
            self._seconds = time.perf_counter() - t0

        self._thread = threading.Thread(target=run, name="dlo-warmup-denoise", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()

    def seconds(self) -> float:
        """Its seconds, once `wait` returned; what it raised, raised here."""
        if self._error is not None:
            raise self._error
        return self._seconds
