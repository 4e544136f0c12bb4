"""peft's merge of a LoRA delta into a weight, in its two torch steps: the bytes every merge gives.

Owns: `two_steps` (`out` = W + factor * (B A), rounded as peft 0.21's `lora.Linear.merge` rounds:
[Note: LoRA merge order] in `dlo.engine.lora.merge`) and `HALF_ON_CPU` (the dtypes peft merges in
float32 on cpu). `dlo.engine.lora.merge` runs it where the one-pass kernel does not take a merge;
`dlo.engine.lora.merge_kernel` checks each kind of its kernel's merges against it.
Must never: import peft or another dlo module (both merge modules build on it), or write into the
weight it reads.
"""

from __future__ import annotations

from typing import Any

import torch

HALF_ON_CPU = (torch.float16, torch.bfloat16)  # what peft merges in float32 on cpu


def two_steps(out: torch.Tensor, weight: torch.Tensor, B: torch.Tensor, A: torch.Tensor, factor: Any) -> None:
    """`out` = `weight` + factor * (B A), in peft's two steps."""
    if out.device.type == "cpu" and B.dtype in HALF_ON_CPU:
        delta = B.float() @ A.float()
        out.copy_(delta if factor is None else delta * factor)
    else:
        torch.mm(B, A, out=out)
        if factor is not None:
            out.mul_(factor)
    out.add_(weight)
