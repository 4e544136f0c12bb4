"""FP8 weight arithmetic: float8 e4m3 with a float32 scale per output row (`dlo.engine.fp8` holds the
rule), used by `dlo quantize` and by the engine's load.

Owns: `quantize_fp8` (one weight -> FP8 values and scales), `dequantize_into` (FP8 values and scales
-> the compute dtype, into a given tensor: the one function every mode dequantizes with, so bytes are
identical across modes), `InMemoryFp8` (a bfloat16 folder's FP8 bytes computed at load, for the arena;
`dlo quantize`, in `dlo.engine.fp8_folder`, writes a folder's FP8 bytes through it too).
Must never: quantize what `dlo.engine.fp8.quantizable` leaves out.
"""

from __future__ import annotations

from typing import Any

import torch

from dlo.engine.fp8 import E4M3_MAX

# the smallest scale: a row of zeros quantizes to zeros (no division by zero)
_TINY = torch.finfo(torch.float32).tiny


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(q, scale)` of a 2-D weight: `scale[r] = max |weight[r]| / 448` (float32), `q = weight / scale`
    rounded to float8 e4m3 (round to nearest even; |q| <= 448, so nothing saturates)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp(min=_TINY)
    return (w / scale.unsqueeze(1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def dequantize_into(out: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`out = q * scale[:, None]` in `out`'s dtype: FP8 to `out` exactly, then one multiply in float32
    rounded once (two kernels, no temporary the size of the weight)."""
    out.copy_(q)
    out.mul_(scale.unsqueeze(1))
    return out


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

