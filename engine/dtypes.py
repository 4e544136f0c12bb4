"""safetensors dtype names <-> torch dtypes (torch imported at call time only).

Owns: the one map between safetensors dtype names and torch dtypes.
Must never: import torch at module import (the torch-free checkpoint code shares these names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "F16": "float16",
    "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32", "I64": "int64",
    "U64": "uint64", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "C64": "complex64", "F8_E8M0": "float8_e8m0fnu",
}


def torch_dtype(name: str) -> "torch.dtype":
    import torch

    return getattr(torch, _NAMES[name])


def safetensors_name(dtype: "torch.dtype") -> str:
    short = str(dtype).removeprefix("torch.")
    for k, v in _NAMES.items():
        if v == short:
            return k
    raise KeyError(f"no safetensors name for {dtype}")
