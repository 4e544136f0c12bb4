"""Status of a DLODeployment: metav1.Condition bookkeeping and the status computed from children.

Owns: `set_condition` (lastTransitionTime moves only when a condition's status changes),
`summarize`, a pure function from what was `Observed` (the engine pods, the node profiles, why pods
are not ready, the model's fetches) to the status fields the operator patches, and `crash_looping`, which finds the engine pods' crash-looping
containers in the pods' container statuses.
Must never: talk to the API server.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Literal

from dlo.operator.models import NodeStatus
from dlo.operator.pod_reasons import Problem

ConditionStatus = Literal["True", "False", "Unknown"]
Verdict = tuple[str, str, str]  # (status, reason, message) of one condition
CONDITION_TYPES = ("Ready", "Progressing", "CacheWarmed", "ModelReady", "Degraded", "PlanOutdated")


def now() -> str:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def set_condition(
    conditions: list[dict[str, Any]],
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str = "",
    generation: int | None = None,
    at: str | None = None,
) -> list[dict[str, Any]]:
    """A copy of `conditions` with `type_` set; its lastTransitionTime moves only on a status change."""
    previous = condition(conditions, type_)
    changed = previous is None or previous.get("status") != status
    cond = {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": (at or now()) if changed else previous["lastTransitionTime"],
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    out = [c for c in conditions if c.get("type") != type_] + [cond]
    return sorted(out, key=lambda c: (CONDITION_TYPES + (c["type"],)).index(c["type"]))


def condition(conditions: list[dict[str, Any]], type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions if c.get("type") == type_), None)


# A container that is not running and has restarted this often is crash-looping even before the
# kubelet says CrashLoopBackOff (it says so only while it waits between restarts).
CRASH_RESTARTS = 3


def crash_looping(pods: list[dict[str, Any]]) -> list[str]:
    """One line per crash-looping container of the engine pods (engine or warmer), e.g.
    `pod wan-0 container engine: CrashLoopBackOff, 5 restarts, last exit 1 (Error)`; empty when
    none. A container running again (or a pod replaced) is no longer reported: Degraded clears."""
    out = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        if pod.get("metadata", {}).get("deletionTimestamp"):
            continue
        st = pod.get("status", {}) or {}
        for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
            state = cs.get("state") or {}
            waiting = (state.get("waiting") or {}).get("reason", "")
            restarts = int(cs.get("restartCount") or 0)
            if waiting != "CrashLoopBackOff" and (restarts < CRASH_RESTARTS or "running" in state):
                continue
            last = (cs.get("lastState") or {}).get("terminated") or state.get("terminated") or {}
            exit_info = f", last exit {last['exitCode']} ({last.get('reason', '')})" if "exitCode" in last else ""
            what = waiting or "restarting"
            out.append(f"pod {pod['metadata']['name']} container {cs.get('name')}: {what}, {restarts} restarts{exit_info}")
    return out


def pod_ready(pod: dict[str, Any]) -> bool:
    conds = pod.get("status", {}).get("conditions", []) or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


@dataclass
class Observed:
    """What one status summary is computed from."""

    desired: int
    template_hash: str
    pods: list[dict[str, Any]]  # the engine pods
    cached: dict[str, float | None]  # node name -> page-cache residency of the model (its profile)
    threshold: float
    warm_enabled: bool
    hash_annotation: str
    problems: list[Problem] = field(default_factory=list)  # why pods are not ready (pod_reasons)
    model: Verdict | None = None  # ModelReady (model.uri, lora.uri), None for folders every node has
    fetches: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> NodeModelStatus fields
    lora_fetches: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> the adapters' (lora.uri)
    rolling_for_model: str = ""  # why the pods stay on the old model (a new one is still being fetched)


def _nodes(o: Observed, live: list[dict[str, Any]]) -> list[NodeStatus]:
    phases = {p["spec"]["nodeName"]: p.get("status", {}).get("phase", "Unknown")
              for p in sorted(live, key=lambda p: p["metadata"]["name"]) if p.get("spec", {}).get("nodeName")}
    return [NodeStatus(name=n, phase=phases.get(n), cached_ratio=o.cached.get(n) if n in phases else None,
                       model=o.fetches.get(n), lora=o.lora_fetches.get(n))  # type: ignore[arg-type]
            for n in sorted(set(phases) | set(o.fetches) | set(o.lora_fetches))]


def _not_ready(o: Observed, ready: int) -> Verdict:
    counted = f"{ready}/{o.desired} engine pods ready"
    if o.model is not None and o.model[0] != "True":
        return ("False", o.model[1], f"{o.model[2]}; {counted}")
    if o.problems:
        lines = "; ".join(p.line() for p in o.problems[:3])
        return ("False", o.problems[0].reason, f"{lines}; {counted}"[:1000])
    return ("False", "ReplicasNotReady", counted)


def summarize(o: Observed) -> dict[str, Any]:
    """Replica counts, per-node status and condition verdicts from the engine pods.

    Returns `replicas`, `readyReplicas`, `updatedReplicas`, `nodes`, `cachedRatio` and the
    verdicts `(status, reason, message)` of Ready, Progressing, CacheWarmed (and ModelReady).
    """
    live = [p for p in o.pods if not p.get("metadata", {}).get("deletionTimestamp")]
    ready = [p for p in live if pod_ready(p)]
    updated = [p for p in live if p.get("metadata", {}).get("annotations", {}).get(o.hash_annotation) == o.template_hash]
    nodes = _nodes(o, live)
    ratios = [n.cached_ratio for n in nodes if n.phase is not None]
    cached_ratio = min(ratios) if ratios and None not in ratios else None  # type: ignore[type-var]

    if o.desired == 0:
        ready_v: Verdict = ("True", "ScaledToZero", "no replicas requested")
    elif len(ready) >= o.desired and len(updated) >= o.desired:
        ready_v = ("True", "AllReplicasReady", f"{len(ready)}/{o.desired} engine pods ready")
    else:
        ready_v = _not_ready(o, len(ready))
    if o.rolling_for_model:
        progressing_v: Verdict = ("True", "Fetching", o.rolling_for_model)
    elif len(live) == o.desired and len(updated) == o.desired and len(ready) == o.desired:
        progressing_v = ("False", "RolloutComplete", "every pod runs the current template")
    else:
        rolling = f"{len(updated)}/{o.desired} pods on the current template, {len(ready)} ready"
        reason = o.problems[0].reason if o.problems else "RollingOut"
        progressing_v = ("True", reason, f"{rolling}; {o.problems[0].line()}" if o.problems else rolling)
    if not o.warm_enabled:
        warm_v: Verdict = ("Unknown", "WarmerDisabled", "spec.warmer.enabled is false")
    elif not ratios or cached_ratio is None:
        warm_v = ("Unknown", "NoResidencyReported", "no node profile reports this model's residency yet")
    elif cached_ratio >= o.threshold:
        warm_v = ("True", "PageCacheWarm", f"lowest residency {cached_ratio:.3f} >= {o.threshold}")
    else:
        warm_v = ("False", "PageCacheCold", f"lowest residency {cached_ratio:.3f} < {o.threshold}")
    verdicts = {"Ready": ready_v, "Progressing": progressing_v, "CacheWarmed": warm_v}
    verdicts["ModelReady"] = o.model or ("True", "LocalFolder", "the model is a folder every node mounts")
    return {
        "replicas": len(live),
        "readyReplicas": len(ready),
        "updatedReplicas": len(updated),
        "nodes": [n.model_dump(by_alias=True, exclude_none=True) for n in nodes],
        "cachedRatio": cached_ratio,
        "verdicts": verdicts,
    }
