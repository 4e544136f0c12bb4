"""Status of a DLODeployment: metav1.Condition bookkeeping and the status computed from children.

Owns: `set_condition` (lastTransitionTime moves only when a condition's status changes),
`summarize`, a pure function from the StatefulSet, its pods and the node profiles to the status
fields the operator patches, and `crash_looping`, which finds the engine pods' crash-looping
containers in the pods' container statuses.
Must never: talk to the API server.
"""

from __future__ import annotations

import datetime
from typing import Any, Literal

from dlo.operator.models import NodeStatus

ConditionStatus = Literal["True", "False", "Unknown"]
CONDITION_TYPES = ("Ready", "Progressing", "CacheWarmed", "Degraded")


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


def _pod_ready(pod: dict[str, Any]) -> bool:
    conds = pod.get("status", {}).get("conditions", []) or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)


def summarize(
    desired: int,
    template_hash: str,
    pods: list[dict[str, Any]],
    cached: dict[str, float | None],
    threshold: float,
    warm_enabled: bool,
    hash_annotation: str,
) -> dict[str, Any]:
    """Replica counts, per-node status and condition verdicts from the engine pods.

    `cached` maps node name -> page-cache residency of the model (from that node's profile).
    Returns `replicas`, `readyReplicas`, `updatedReplicas`, `nodes`, `cachedRatio` and the
    verdicts `(status, reason, message)` of Ready, Progressing and CacheWarmed.
    """
    live = [p for p in pods if not p.get("metadata", {}).get("deletionTimestamp")]
    ready = [p for p in live if _pod_ready(p)]
    updated = [
        p for p in live if p.get("metadata", {}).get("annotations", {}).get(hash_annotation) == template_hash
    ]
    nodes: list[NodeStatus] = []
    for pod in sorted(live, key=lambda p: p["metadata"]["name"]):
        node = pod.get("spec", {}).get("nodeName")
        if not node:
            continue
        nodes.append(
            NodeStatus(name=node, phase=pod.get("status", {}).get("phase", "Unknown"), cached_ratio=cached.get(node))
        )
    ratios = [n.cached_ratio for n in nodes]
    cached_ratio = min(ratios) if ratios and None not in ratios else None

    if desired == 0:
        ready_v = ("True", "ScaledToZero", "no replicas requested")
    elif len(ready) >= desired and len(updated) >= desired:
        ready_v = ("True", "AllReplicasReady", f"{len(ready)}/{desired} engine pods ready")
    else:
        ready_v = ("False", "ReplicasNotReady", f"{len(ready)}/{desired} engine pods ready")
    if len(live) == desired and len(updated) == desired and len(ready) == desired:
        progressing_v = ("False", "RolloutComplete", "every pod runs the current template")
    else:
        progressing_v = (
            "True",
            "RollingOut",
            f"{len(updated)}/{desired} pods on the current template, {len(ready)} ready",
        )
    if not warm_enabled:
        warm_v = ("Unknown", "WarmerDisabled", "spec.warmer.enabled is false")
    elif not nodes or cached_ratio is None:
        warm_v = ("Unknown", "NoResidencyReported", "no node profile reports this model's residency yet")
    elif cached_ratio >= threshold:
        warm_v = ("True", "PageCacheWarm", f"lowest residency {cached_ratio:.3f} >= {threshold}")
    else:
        warm_v = ("False", "PageCacheCold", f"lowest residency {cached_ratio:.3f} < {threshold}")
    return {
        "replicas": len(live),
        "readyReplicas": len(ready),
        "updatedReplicas": len(updated),
        "nodes": [n.model_dump(by_alias=True, exclude_none=True) for n in nodes],
        "cachedRatio": cached_ratio,
        "verdicts": {"Ready": ready_v, "Progressing": progressing_v, "CacheWarmed": warm_v},
    }
