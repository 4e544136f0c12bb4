"""An adapter's tensors: read through the family's diffusers loader, checked, and made into branches.

Owns: `read_adapter` (the file through `<Pipeline>.lora_state_dict`, diffusers' own peft-free reader
and converter of community formats, then `plan_adapter`'s checks on what it returned), `Branch` (one
linear layer's A, B, bias and peft scaling on the device, in the layer's dtype) and `branches`
(every targeted layer of a loaded transformer).
Must never: import peft, or change an adapter's numbers beyond what peft does to them (a cast to the
layer's dtype) and an exact power-of-two rescale (`_fold`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch import nn

from dlo.engine.checkpoint import TensorInfo
from dlo.engine.dtypes import safetensors_name
from dlo.engine.lora.adapters import PREFIX, AdapterEntry, AdapterError, AdapterPlan, plan_adapter


@dataclass(frozen=True)
class RawAdapter:
    """An adapter as diffusers read it (host tensors, `transformer.`-prefixed keys) and its plan."""

    plan: AdapterPlan
    state: dict[str, torch.Tensor]


def read_adapter(entry: AdapterEntry, pipeline_class: str, weights: Mapping[str, TensorInfo]) -> RawAdapter:
    """Read `entry` as the pipeline's `load_lora_weights` would (safetensors only: never a pickle)
    and check it against the transformer's checkpoint tensors `weights`."""
    import diffusers

    from dlo.engine.lora.adapters import parse_metadata

    loader = getattr(diffusers, pipeline_class)
    try:
        # Flux's reader also returns the `.alpha` values it pops (network alphas); the others ignore it.
        out = loader.lora_state_dict(str(entry.path.parent), weight_name=entry.path.name, use_safetensors=True,
                                     return_lora_metadata=True, return_alphas=True)
    except Exception as e:  # diffusers' converters raise whatever they meet (KeyError, ValueError, ...)
        raise AdapterError(entry.path, f"{pipeline_class}.lora_state_dict cannot read it: {type(e).__name__}: {e}") from None
    state, alphas, metadata = out if len(out) == 3 else (out[0], None, out[1])
    if metadata is not None:  # what lora_state_dict returns is the parsed JSON, prefixes and all
        import json

        metadata = parse_metadata(entry.path, {"lora_adapter_metadata": json.dumps(metadata)})
    alphas = {k[len(PREFIX):]: v for k, v in (alphas or {}).items() if k.startswith(PREFIX)}
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    dtypes = {k: safetensors_name(v.dtype) for k, v in state.items()}
    return RawAdapter(plan_adapter(entry, shapes, dtypes, metadata, alphas, weights), state)


@dataclass(frozen=True)
class Branch:
    """One linear layer's low-rank branch. `scaling` is peft's alpha / r (a float, or a 0-dim tensor
    for a Flux file's `.alpha` keys); 1.0 where a power of two was folded into B (`_fold`)."""

    A: torch.Tensor  # (r, in)
    B: torch.Tensor  # (out, r)
    bias: torch.Tensor | None  # (out,)
    scaling: Any

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.A, self.B, self.bias) if t is not None)


def branches(raw: RawAdapter, root: nn.Module, device: torch.device,
             dtype_of: Callable[[str], torch.dtype]) -> dict[nn.Module, Branch]:
    """The branch of every layer `raw` targets in the transformer `root`, on `device` in the dtype
    its weight computes in (`dtype_of(name)`: a streamed weight is a placeholder between forwards),
    what peft's `_move_adapter_to_device_of_base_layer` does."""
    out: dict[nn.Module, Branch] = {}
    for m in raw.plan.modules:
        try:
            layer = root.get_submodule(m.module)
        except AttributeError:
            layer = None
        if not isinstance(layer, nn.Linear):
            raise AdapterError(raw.plan.path, f"module {m.module}: not an nn.Linear of {type(root).__name__} "
                                              f"({type(layer).__name__})")
        dtype = dtype_of(f"{m.module}.weight")
        key = PREFIX + m.module
        # copies of their own (never views of the file's buffer): see `_trainable`
        A = raw.state[f"{key}.lora_A.weight"].to(device=device, dtype=dtype, copy=True)
        B = raw.state[f"{key}.lora_B.weight"].to(device=device, dtype=dtype, copy=True)
        bias = raw.state.get(f"{key}.lora_B.bias")
        if m.bias:  # peft gives lora_B a bias when the config says lora_bias; zeros where the file has none
            bias = (torch.zeros(m.out_features, dtype=dtype, device=device) if bias is None
                    else bias.to(device=device, dtype=dtype, copy=True))
        out[layer] = _trainable(_fold(Branch(A, B, bias, raw.plan.rule.scaling(m.module))))
    return out


def _trainable(b: Branch) -> Branch:
    """The branch's tensors flagged `requires_grad`, as peft's adapter parameters are (it marks them
    trainable). Never used for a gradient (requests run under inference mode), but the flag steers
    ATen's kernel choice: `matmul` folds a 3-d input with a strided batch into one 2-d product only
    when the weight (its transposed view: hence leaves of their own, not views of the file's
    buffer, whose views lose the flag in inference mode) requires grad, else it runs a batched
    product whose sums round differently (measured on CPU: Flux's `attn.to_out.0` input is a slice
    of the joint sequence, 1 ulp apart)."""
    for t in (b.A, b.B, b.bias):
        if t is not None:
            t.requires_grad_(True)
    return b


def _fold(b: Branch) -> Branch:
    """A scaling that is a power of two (alpha = r/2, r/4, 2r, ...) folded into B and the bias.

    Exact: scaling every input of a dot product by 2^k scales its products, partial sums and final
    rounding by 2^k (floating point is scale-invariant by powers of two), so h B'^T equals
    round(h B^T) * 2^k bit for bit, and a request saves the multiply pass over its (tokens x out)
    result; kept only where B * 2^k loses nothing (no element leaves the normal range)."""
    s = b.scaling
    if not isinstance(s, float) or s == 1.0 or s <= 0 or math.frexp(s)[0] != 0.5:
        return b
    B, bias = b.B * s, (b.bias * s if b.bias is not None else None)
    exact = all(torch.equal(t * (1.0 / s), orig) and bool(torch.isfinite(t).all())
                for t, orig in ((B, b.B), (bias, b.bias)) if t is not None)
    return Branch(b.A, B, bias, 1.0) if exact else b
