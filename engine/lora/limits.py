"""What an adapter's numbers and patterns may be, checked at start so a hostile or broken file is one
line there rather than black images or a hung rank later.

Owns: `check_values` (every float tensor of the file read once: NaN or infinity refused, a weight
beyond `MAX_ABS_WEIGHT` or an alpha beyond `MAX_ABS_ALPHA` refused), `check_alpha` (the metadata's
`lora_alpha` and `alpha_pattern` values) and `check_patterns` (peft's `rank_pattern` /
`alpha_pattern` keys: at most `MAX_PATTERN_CHARS`, a regular expression `re` compiles, and the
adapter's modules all resolved with them within `MATCH_BUDGET_S`, by `re` in a child process that
is killed at the bound, before this process ever runs a match of them).
Must never: import torch (`dlo serve` checks adapters before any rank starts), or hold more than one
chunk of an adapter's data in memory.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from dlo.engine.checkpoint import TensorInfo, open_regular
from dlo.engine.lora.errors import AdapterError

MAX_ABS_WEIGHT = 1e3  # trained LoRA factors are well below 1; past this the merge overflows half precision
MAX_ABS_ALPHA = 1e4  # lora_alpha (scale alpha / r); a larger one drowns the model as surely
MAX_PATTERN_CHARS = 512
MATCH_BUDGET_S = 3.0  # every module of an adapter resolved (a child's start included): a real one takes ms
_CHUNK = 64 * 2**20
_NUMPY = {"F16": "<f2", "F32": "<f4", "F64": "<f8", "BF16": "<u2"}


def check_values(path: Path, tensors: Mapping[str, TensorInfo]) -> None:
    """Refuse (`AdapterError` naming the key) a float tensor of `path` holding NaN or infinity, a
    weight beyond `MAX_ABS_WEIGHT` or an `.alpha` beyond `MAX_ABS_ALPHA`."""
    import numpy as np

    with open_regular(path) as f:
        for name, t in tensors.items():
            if t.dtype not in _NUMPY:
                continue  # not a float type: the plan refuses it by name
            bound = MAX_ABS_ALPHA if name.endswith(".alpha") else MAX_ABS_WEIGHT
            step = _CHUNK - _CHUNK % np.dtype(_NUMPY[t.dtype]).itemsize
            for offset in range(t.start, t.end, step):
                f.seek(offset)
                data = np.frombuffer(f.read(min(step, t.end - offset)), dtype=_NUMPY[t.dtype])
                if t.dtype == "BF16":
                    data = (data.astype(np.uint32) << 16).view(np.float32)
                if not np.isfinite(data).all():
                    raise AdapterError(path, f"key {name}: holds NaN or infinite values (a diverged training "
                                             "run?): it would turn every image it touches black")
                peak = float(np.abs(data).max(initial=0.0))
                if peak > bound:
                    raise AdapterError(path, f"key {name}: holds a value of {peak:.4g}, beyond ±{bound:g}: no trained "
                                             "adapter has one, and it would overflow the merge")


def check_alpha(path: Path, values: Iterable[Any]) -> None:
    """Refuse a metadata `lora_alpha` or `alpha_pattern` value beyond `MAX_ABS_ALPHA`."""
    for value in values:
        if isinstance(value, (int, float)) and math.isfinite(value) and abs(value) > MAX_ABS_ALPHA:
            raise AdapterError(path, f"metadata lora_alpha / alpha_pattern value {value:.6g} is beyond "
                                     f"±{MAX_ABS_ALPHA:g}: the adapter would drown the model")


def check_patterns(path: Path, field: str, patterns: Iterable[str], modules: Iterable[str]) -> None:
    """Refuse a `field` pattern that is too long or not a regular expression, and the patterns when
    resolving every module of the adapter with them (peft's `get_pattern_key`: the first that
    matches the end of the name at a dot boundary) does not end within `MATCH_BUDGET_S` - run by
    `re` itself in a child process that is killed at the bound (a match `re` runs cannot be stopped,
    and another engine's speed on a pattern says nothing of `re`'s)."""
    keys, names = list(patterns), list(modules)
    for key in keys:
        shown = repr(key[:60]) + ("..." if len(key) > 60 else "")
        if len(key) > MAX_PATTERN_CHARS:
            raise AdapterError(path, f"metadata {field} key {shown} is {len(key)} characters; at most "
                                     f"{MAX_PATTERN_CHARS}")
        try:
            re.compile(key)
            re.compile(rf"(.*\.)?({key})$")
        except (re.error, RecursionError, OverflowError) as e:
            raise AdapterError(path, f"metadata {field} key {shown} is not a regular expression: {e}") from None
    if not keys or not names:
        return
    try:
        subprocess.run([sys.executable, "-I", "-c", _RESOLVE], input=json.dumps({"keys": keys, "modules": names}),
                       capture_output=True, text=True, timeout=MATCH_BUDGET_S, check=True)
    except subprocess.TimeoutExpired:
        raise AdapterError(path, f"metadata {field}: matching its {len(keys)} patterns against the adapter's "
                                 f"{len(names)} modules takes over {MATCH_BUDGET_S:g} s: a pattern that backtracks "
                                 "without bound is refused") from None
    except (subprocess.CalledProcessError, OSError) as e:
        raise AdapterError(path, f"metadata {field}: its patterns could not be checked: {e}") from None


# peft's get_pattern_key over every module, in a child process (the bound above kills it)
_RESOLVE = """import json, re, sys
d = json.load(sys.stdin)
ps = [re.compile(r"(.*\\.)?(" + k + r")$") for k in d["keys"]]
for m in d["modules"]:
    next((p for p in ps if p.match(m)), None)
"""
