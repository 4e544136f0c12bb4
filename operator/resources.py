"""Compute resources of every container the operator creates: never BestEffort.

Owns: the engine container's requests (memory from the plan's per-pod host estimate, CPU by rank
count) merged with `spec.engine.resources`, the warmer's and the fetcher's defaults merged with
their overrides, and the accelerator limit.

Memory: the pod's cgroup is charged for the runtime and anonymous memory of its ranks and for the
page cache it is the first to fault in (the policy's `cold_start_peak_bytes`: page cache + pinned
memory the cgroup sees + per-rank framework). The warmer init container faults the model's pages in
first; its charge stays with the pod cgroup when it exits (cgroup v2 reparents it), and a pod's
effective request is the larger of its init containers' and the sum of its containers', so the
estimate sits on the engine's request and the warmer asks only for its own runtime. Page cache
another cgroup faulted in first (the agent's warmer, a pod before) stays charged there: the request
is then an upper bound. `dlo_pod_cgroup_memory_bytes{kind="file"}` of the agent shows what the pod
is really charged. No memory limit by default: pinned pages cannot be reclaimed, so a limit below
the peak is an OOM kill, not back-pressure.
Must never: set a request above a limit the user gave (the request is lowered to it), or drop the
accelerator limit.
"""

from __future__ import annotations

import json
import math
from typing import Any

from dlo.operator.models import DLODeploymentSpec

MIB = 2**20
# Without model facts (no profile, no spec.model.facts): a floor per rank, so the pod is never
# BestEffort; the facts, once an agent reports them, replace it.
FALLBACK_BYTES_PER_RANK = 2 * 2**30
CPU_PER_RANK = 1
WARMER_DEFAULTS = {"requests": {"cpu": "250m", "memory": "256Mi"}}
FETCHER_DEFAULTS = {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity_bytes(value: Any) -> int | None:
    """A memory quantity in bytes (None when it is not one this code reads)."""
    text = str(value).strip()
    for unit, factor in _UNITS.items():
        if text.endswith(unit):
            try:
                return int(float(text[: -len(unit)]) * factor)
            except ValueError:
                return None
    try:
        return int(float(text))
    except ValueError:
        return None


def mebibytes(n: int) -> str:
    return f"{math.ceil(n / MIB)}Mi"


def merged(defaults: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`defaults` with `override`'s requests and limits over them, key by key; a request above the
    limit the override sets is lowered to that limit (the API server refuses it otherwise)."""
    out = json.loads(json.dumps(defaults))
    for section in ("requests", "limits", "claims"):
        if section in override:
            if isinstance(override[section], dict):
                out.setdefault(section, {}).update(override[section])
            else:
                out[section] = override[section]
    for key, limit in (out.get("limits") or {}).items():
        request = (out.get("requests") or {}).get(key)
        if request is not None and key == "memory":
            r, lim = quantity_bytes(request), quantity_bytes(limit)
            if r is not None and lim is not None and r > lim:
                out["requests"][key] = limit
    return out


def engine_resources(spec: DLODeploymentSpec, memory_bytes: int | None) -> dict[str, Any]:
    """The engine container's resources: the estimate (or the per-rank floor), CPU per rank, the
    user's overrides, and the accelerator limit (and request, when requests name it)."""
    ranks = spec.devices_per_node
    memory = memory_bytes if memory_bytes else FALLBACK_BYTES_PER_RANK * ranks
    defaults = {"requests": {"cpu": str(CPU_PER_RANK * ranks), "memory": mebibytes(memory)}}
    resources = merged(defaults, spec.engine.resources)
    if spec.engine.device != "cpu":
        resources.setdefault("limits", {})[spec.accelerator_resource] = spec.devices_per_node
        resources["requests"][spec.accelerator_resource] = spec.devices_per_node
    return resources


def warmer_resources(spec: DLODeploymentSpec) -> dict[str, Any]:
    return merged(WARMER_DEFAULTS, spec.warmer.resources)


def fetcher_resources() -> dict[str, Any]:
    """A fetch: parallel ranged transfers of a few MiB each; the page cache its writes dirty is
    written back under the limit."""
    return json.loads(json.dumps(FETCHER_DEFAULTS))
