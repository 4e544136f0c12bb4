"""Modules constructed with their parameters on the `meta` device and their buffers real.

Owns: `parameters_on_meta` (the context every meta-device build runs its constructors in:
`dlo.engine.model`'s streamed models, the families' whole components `families/whole.py`, the
random-weight writer `random_model.py`).
Must never: import anything of dlo (the families package's torch-free modules reach it from their
functions, below `dlo.engine.model`), or allocate a parameter's data.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block lands on `meta`; buffers stay real.

    Module constructors then run their own `reset_parameters` on meta tensors (no compute), while
    buffers a constructor computes (RoPE tables) keep their values.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
