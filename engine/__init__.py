"""dlo.engine: the Distributed Layerwise Offload engine.

Importing this package must not import torch (the agent and operator import the torch-free
`dlo.engine.checkpoint`, `dlo.engine.families` and `dlo.engine.blocks`). `load` and
`OffloadedModel`, `early_registration` (the first step of `load`, started ahead of it by a caller
that has other work to overlap it with) and `PrefetchOrderError` (a forward stopped between
streamed blocks: the engine must restart) are resolved lazily from `dlo.engine.offload`; `LoadReport` and `GatherStats` from the torch-free `dlo.engine.report`, the
settings (`OffloadSettings`, `ParallelSettings`, `EngineSettings`, `ConfigError`) from the
torch-free `dlo.engine.settings`.

Map: the offload core sits here (checkpoint, layout, dtypes, facts, model, weights, arena,
prefetch, hooks, platform, report, offload = `load`; the request type in request.py, a model's
blocks in blocks.py); one adapter per model family in `families/`; the server in `serving/` (see
docs/engine.md).

Owns: the public API names (`load`, `early_registration`, `OffloadedModel`, `PrefetchOrderError`,
`LoadReport`, `GatherStats`, the settings): what `dlo.serving` and the benchmarks use.
Must never: import torch at package import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from dlo.engine.offload import OffloadedModel, PrefetchOrderError, early_registration, load
    from dlo.engine.report import GatherStats, LoadReport
    from dlo.engine.settings import ConfigError, EngineSettings, OffloadSettings, ParallelSettings

_SETTINGS = ("OffloadSettings", "ParallelSettings", "EngineSettings", "ConfigError")
__all__ = ["load", "early_registration", "OffloadedModel", "PrefetchOrderError", "LoadReport", "GatherStats",
           *_SETTINGS]


def __getattr__(name: str) -> Any:
    if name in ("LoadReport", "GatherStats"):
        from dlo.engine import report

        return getattr(report, name)
    if name in _SETTINGS:
        from dlo.engine import settings

        return getattr(settings, name)
    if name in __all__:
        from dlo.engine import offload

        return getattr(offload, name)
    raise AttributeError(f"module 'dlo.engine' has no attribute {name!r}")
