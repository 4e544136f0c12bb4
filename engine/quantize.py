"""FP8 weight arithmetic: float8 e4m3 with a float32 scale per output row (`dlo.engine.fp8` holds the
rule), used by `dlo quantize` and by the engine's load.

Owns: `quantize_fp8` (one weight -> FP8 values and scales), `dequantize_into` (FP8 values and scales
-> the compute dtype, into a given tensor: the one function every mode dequantizes with, so bytes are
identical across modes: one fused kernel on cuda, `fused_dequantize`, else
`dequantize_in_two_kernels`), `InMemoryFp8` (a bfloat16 folder's FP8 bytes computed at load, for
the arena; `dlo quantize`, in `dlo.engine.fp8_folder`, writes a folder's FP8 bytes through it too).
Must never: quantize what `dlo.engine.fp8.quantizable` leaves out.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import torch

from dlo.engine.fp8 import E4M3_MAX

# the smallest scale: a row of zeros quantizes to zeros (no division by zero)
_TINY = torch.finfo(torch.float32).tiny

log = logging.getLogger(__name__)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, scale)` of a 2-D weight: `scale[r] = max |weight[r]| / 448` (float32), `q = weight / scale`
    rounded to float8 e4m3 (round to nearest even; |q| <= 448, so nothing saturates)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp(min=_TINY)
    return (w / scale.unsqueeze(1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def dequantize_into(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`out = q * scale[:, None]` in `out`'s dtype, the product in float32 rounded once: one fused
    kernel where the device has a compiler for it (`fused_dequantize`), else two kernels; both give
    the same bytes ([Note: one dequantization, two kernels or one])."""
    device_type = out.device.type
    fused = fused_dequantize(device_type)
    if fused is not None:
        try:
            fused(out, q, scale)  # compiles on a shape's first call: a failure shows here
            return out
        except Exception as e:  # whatever it wrote, the two kernels compute all of `out` again
            _give_up_fused(device_type, e)
    return dequantize_in_two_kernels(out, q, scale)


def dequantize_in_two_kernels(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 to `out` exactly, then one multiply in float32 rounded once (no temporary the size of the
    weight; 7 bytes of memory traffic a weight)."""
    out.copy_(q)
    out.mul_(scale.unsqueeze(1))
    return out


def _dequantize_fused(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
    """What the fused kernel computes (written for `torch.compile`: one read of each FP8 value and one
    write of its result, 3 bytes a weight)."""
    out.copy_((q.to(torch.float32) * scale.unsqueeze(1)).to(out.dtype))


# [Note: one dequantization, two kernels or one]
# FP8 streaming dequantizes every streamed block on the compute stream. The two-kernel form (copy,
# then an in-place multiply) moves 7 bytes a weight through unvectorised float8 kernels: 2.48 ms for
# a Flux.1-dev double block on the H200 (960 GB/s), ~1.5 ms a block on average, which made a 24 GiB
# Flux request 0.66x of bfloat16 streaming instead of the ~0.53x its copies allow. `torch.compile`
# of `_dequantize_fused` (a Triton kernel) did the same block in 0.62 ms with the same bytes
# (record `fp8-dequant-h200-2026-12-01`). A second stream for the two kernels
# hid only 29% of them behind the block's GEMMs, so the kernel's cost, not its stream, is the fix.
# Both forms compute float32(q) * scale rounded once to `out`'s dtype (float8 to bfloat16 is exact),
# so they give the same bytes; the fallback covers devices without Triton and a compiler that fails
# (a warning, once). Shapes are dynamic after the first (torch.compile's default): a model's few
# weight shapes compile at most twice, during the load or the warm-up, never in a request.
# Since `fp8-dequant-h200-2026-12-02-c` a streamed block runs neither: its weights are dequantized
# in one launch (`dlo.engine.fp8_kernel`, checked against this function's bytes). Timed on the
# device alone, the compiled form here takes 0.30 ms for that block returning a new tensor and
# 0.76 ms in place (two passes), and its host ~65 us a call to launch: the 0.62-1.04 ms above were
# launch times. This function stays for resident FP8 weights (once, at the load) and as the
# fallback of the one-launch kernel.
_FUSED: dict[str, Any] = {}
_FUSED_LOCK = threading.Lock()


def fused_dequantize(device_type: str, compile_fn: Callable[..., Any] | None = None) -> Any:
    """The compiled dequantization for `device_type` (cuda only, where Triton is importable), or None:
    the two-kernel form then. Made once per process; a compile that fails, then or at a call, warns
    once and leaves None (`compile_fn` replaces `torch.compile` in tests)."""
    if device_type in _FUSED:  # every weight of every streamed block asks: no lock once decided
        return _FUSED[device_type]
    with _FUSED_LOCK:
        if device_type not in _FUSED:
            _FUSED[device_type] = _compile_fused(compile_fn or torch.compile) if device_type == "cuda" else None
        return _FUSED[device_type]


def _give_up_fused(device_type: str, e: Exception) -> None:
    with _FUSED_LOCK:
        _FUSED[device_type] = None
    log.warning("FP8 dequantization runs in two kernels from here on (the fused kernel failed: %s: %s)",
                type(e).__name__, e)


def _compile_fused(compile_fn: Callable[..., Any]) -> Any:
    try:
        import triton  # noqa: F401  (torch.compile's GPU kernels are Triton's)

        return compile_fn(_dequantize_fused)
    except Exception as e:  # the two-kernel form computes the same bytes
        log.warning("FP8 dequantization runs in two kernels (the fused kernel is unavailable: %s: %s)",
                    type(e).__name__, e)
        return None


def resident_fp8(ckpt: Any, plan: Any, name: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 weight placed whole on the device in `dtype` (a resident block, resident mode): its
    stored or converted values dequantized on the device, as a streamed block's are."""
    if plan.stored:
        q, scale = ckpt.view(name), ckpt.view(plan.quantized[name])
    else:
        q, scale = quantize_fp8(ckpt.view(name))
    out = torch.empty(q.shape, dtype=dtype, device=device)
    return dequantize_into(out, q.to(device), scale.to(device))


class InMemoryFp8:
    """The FP8 bytes of a bfloat16 checkpoint's weights, computed when the arena asks for them
    (`--stream-dtype fp8` on a folder `dlo quantize` has not converted). The last weight's values
    are kept: a weight's scale and its values are asked for one after the other."""

    def __init__(self, ckpt: Any, quantized: dict[str, str]):
        self.ckpt = ckpt
        self.by_scale = {s: w for w, s in quantized.items()}
        self.quantized = quantized
        self._last: tuple[str, torch.Tensor, torch.Tensor] | None = None

    def _of(self, weight: str) -> tuple[torch.Tensor, torch.Tensor]:
        if self._last is None or self._last[0] != weight:
            q, s = quantize_fp8(self.ckpt.view(weight))
            self._last = (weight, q, s)
        return self._last[1], self._last[2]

    def bytes_of(self, name: str) -> torch.Tensor | None:
        """The uint8 bytes of `name` (an FP8 weight or its scale), None for other tensors."""
        if name in self.quantized:
            return self._of(name)[0].view(torch.uint8).flatten()
        if name in self.by_scale:
            return self._of(self.by_scale[name])[1].view(torch.uint8).flatten()
        return None

