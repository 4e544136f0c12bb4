"""dlo.engine: the Distributed Layerwise Offload engine.

Importing this package must not import torch (the agent and operator import the torch-free
`dlo.engine.checkpoint` and `dlo.engine.families`). `load` and the types it returns are resolved
lazily from `dlo.engine.offload`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from dlo.engine.offload import LoadReport, OffloadedModel, load

__all__ = ["load", "OffloadedModel", "LoadReport"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from dlo.engine import offload

        return getattr(offload, name)
    raise AttributeError(f"module 'dlo.engine' has no attribute {name!r}")
