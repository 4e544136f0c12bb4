"""The VAE's decode as a rank runs it: in the VAE's own dtype, and its first call made beside the
warm-up request instead of in it.

[Note: the first decode beside the request]
On the H200 the warm-up request's VAE decode of Wan2.1's smallest image took 0.6-1.1 s of its
2.2 s (`ready-h200-2026-12-02-*`), yet a request's decode is fast once one has run (the check
request after ready took as long as the second): it is the first call's cost (each kernel loaded
on first use, the libraries' first calls at fp32), paid after the text encoding and the denoising
it does not depend on. So once the VAE is on the device, one decode of zeros at the smallest
latent runs on a thread and a stream of its own (`warm_decode_beside`), beside the rest of the load
and the warm-up's text encoding and denoising; the pipeline's decode waits for it before its first
call (the VAEs keep per-call state on the module, Wan's feature cache, so two decodes never run at
once). Zeros in, output dropped, no random numbers, cuDNN benchmarking off as everywhere: the
kernels chosen, and a request's bytes, are the same.

Owns: `decode_in_own_dtype`, `smallest_latent` (the decode input of the smallest image, from the
VAE's config: 3-D VAEs (Wan, QwenImage) and 2-D ones (Flux); None for one it does not know) and
`warm_decode_beside`.
Must never: run two decodes of one VAE at once, change what a request decodes, or fail a start (a
failed first decode is logged and the request pays it instead).
"""

from __future__ import annotations

import logging
from typing import Any

from dlo.engine.serving.prewarm import Background

log = logging.getLogger(__name__)


def decode_in_own_dtype(vae: Any) -> None:
    """Cast the latents to the VAE's dtype on the way in: the VAE runs in float32 (its output becomes
    the bytes) while Flux and QwenImage hand it latents in the transformer's dtype (bfloat16)."""
    inner = vae.decode

    def decode(z: Any, *args: Any, **kwargs: Any) -> Any:
        return inner(z.to(vae.dtype), *args, **kwargs)

    vae.decode = decode  # type: ignore[method-assign]


def smallest_latent(vae: Any, side: int) -> tuple[int, ...] | None:
    """The decode input of one `side` x `side` image: (1, C, 1, h, w) for a 3-D VAE (Wan's,
    QwenImage's), (1, C, h, w) for the 2-D `AutoencoderKL` (Flux); None for any other VAE."""
    import diffusers

    cfg = getattr(vae, "config", None)
    if isinstance(vae, (diffusers.AutoencoderKLWan, diffusers.AutoencoderKLQwenImage)):
        scale = getattr(cfg, "scale_factor_spatial", None) or 2 ** len(cfg.temperal_downsample)
        return (1, int(cfg.z_dim), 1, max(1, side // scale), max(1, side // scale))
    if type(vae) is diffusers.AutoencoderKL:  # subclasses may decode otherwise
        scale = 2 ** (len(cfg.block_out_channels) - 1)
        return (1, int(cfg.latent_channels), max(1, side // scale), max(1, side // scale))
    return None


def warm_decode_beside(pipe: Any, device: Any, side: int) -> Background | None:
    """One decode of zeros at the smallest latent of `pipe`'s VAE on a thread and stream of its own,
    started now, and `pipe.vae.decode` waiting for it before its first call ([Note: the first decode
    beside the request]); None where there is nothing to run (not on cuda, no VAE, one of unknown shape)."""
    import torch

    vae = getattr(pipe, "vae", None)
    shape = None if not isinstance(vae, torch.nn.Module) else smallest_latent(vae, side)
    if shape is None or torch.device(device).type != "cuda":
        return None
    job = Background("first-decode", lambda: first_decode(vae, shape, torch.device(device)))
    gate_decode(vae, job)
    return job


def first_decode(vae: Any, shape: tuple[int, ...], device: Any) -> tuple[int, ...]:
    """One decode of zeros of `shape` through the VAE class's own `decode` (none of the instance's
    wrappers: dtype cast, phases, the gate), on a stream of its own on cuda; returns `shape`."""
    import contextlib

    import torch

    own = type(vae).decode
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    with (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()), torch.inference_mode():
        own(vae, torch.zeros(shape, dtype=vae.dtype, device=device), return_dict=False)
    if stream is not None:
        stream.synchronize()
    return shape


def gate_decode(vae: Any, job: Background) -> None:
    """`vae.decode` waits for `job` (at once once it has ended) before every call; the first call
    logs how long the job took and how long the call waited for it."""
    import time

    inner = vae.decode
    logged = []

    def decode(*args: Any, **kwargs: Any) -> Any:
        if not logged:
            t0 = time.perf_counter()
            job.join()
            logged.append(True)
            log.info("first decode beside the request: %.2f s, the request's decode waited %.2f s for it (shape %s)",
                     job.seconds, time.perf_counter() - t0, job.result)
        return inner(*args, **kwargs)

    vae.decode = decode  # type: ignore[method-assign]
