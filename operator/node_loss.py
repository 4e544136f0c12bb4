"""Engine pods on lost nodes: a node that is NotReady or unreachable holds its pods (a pod deleted
there stays Terminating: no kubelet confirms it), so the StatefulSet cannot recreate them elsewhere.

Owns: `node_lost` (why a node is lost, from its Ready condition and the node controller's taints),
`LostPod` and `lost_pods` (the engine pods on lost nodes, each with the node, why, since when, and
whether the opt-in `spec.rollout.nodeLossGraceSeconds` has run out), the recovery command, and
`node_summary_fields` (what of a node the operator keeps: no heartbeat times).
Must never: talk to the API server or read the clock (the reconcile passes `now`); the force
delete is the reconcile's.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"
LOSS_TAINTS = (UNREACHABLE_TAINT, NOT_READY_TAINT)


def recovery_command(node: str) -> str:
    """Non-graceful node shutdown (Kubernetes 1.28): the pod garbage collector force-deletes the
    node's terminating pods and their volumes detach."""
    return f"kubectl taint nodes {node} {OUT_OF_SERVICE_TAINT}=nodeshutdown:NoExecute"


def _ready_condition(node: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return next((c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), None)


def _taints(node: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list((node.get("spec") or {}).get("taints") or [])


def node_summary_fields(node: Mapping[str, Any]) -> dict[str, Any]:
    """The node's Ready condition (status, reason, lastTransitionTime: not its heartbeat times, so a
    heartbeat changes nothing) and taints (key, value, effect, timeAdded)."""
    ready = _ready_condition(node)
    out: dict[str, Any] = {"taints": [{k: t[k] for k in ("key", "value", "effect", "timeAdded") if k in t}
                                      for t in _taints(node)]}
    if ready is not None:
        out["ready"] = {k: ready[k] for k in ("status", "reason", "lastTransitionTime") if k in ready}
    return out


def node_lost(node: Mapping[str, Any]) -> tuple[str, str] | None:
    """(why, since) when the node is NotReady or unreachable, else None. A node without a Ready
    condition (nothing reports one) is not lost."""
    ready = (node.get("status") or {}).get("ready") or _ready_condition(node)
    taints = {t.get("key"): t for t in _taints(node)}
    if ready is not None and ready.get("status") in ("False", "Unknown"):
        state = "unreachable (its kubelet stopped reporting)" if ready["status"] == "Unknown" else "NotReady"
        reason = f": {ready['reason']}" if ready.get("reason") else ""
        return f"{state}{reason}", ready.get("lastTransitionTime", "")
    for key in LOSS_TAINTS:
        if key in taints:
            return f"tainted {key}", taints[key].get("timeAdded", "")
    return None


def out_of_service(node: Mapping[str, Any]) -> bool:
    return any(t.get("key") == OUT_OF_SERVICE_TAINT for t in _taints(node))


def _seconds(stamp: str) -> float | None:
    try:
        return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except (AttributeError, ValueError):
        return None


@dataclass(frozen=True)
class LostPod:
    pod: str
    uid: str
    node: str
    why: str
    since: str  # RFC 3339, '' when the node says nothing
    terminating: bool
    force_due: bool  # nodeLossGraceSeconds set and run out: the reconcile force-deletes the pod

    def message(self, grace: int | None) -> str:
        """What happened and the way out, naming the node (the pod's name is the caller's)."""
        since = f" since {self.since}" if self.since else ""
        stuck = "Terminating, held by the node" if self.terminating else "not replaced while the node holds it"
        if grace is None:
            fix = (f"once the node is down for good: {recovery_command(self.node)} (or set "
                   "spec.rollout.nodeLossGraceSeconds)")
        else:
            fix = f"the operator force-deletes it {grace}s after the node was lost"
        return f"node {self.node} is {self.why}{since}; the pod is {stuck}; {fix}"


def lost_pods(pods: list[dict[str, Any]], nodes: Mapping[str, Mapping[str, Any]], now: float,
              grace: int | None) -> list[LostPod]:
    """The engine pods whose node is lost, in pod name order. `nodes`: node name -> node (summary);
    `grace`: spec.rollout.nodeLossGraceSeconds (None: never force-delete)."""
    out = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        name = (pod.get("spec") or {}).get("nodeName")
        node = nodes.get(name or "")
        lost = node_lost(node) if node is not None else None
        if lost is None:
            continue
        why, since = lost
        started = _seconds(since)
        due = grace is not None and started is not None and now - started >= grace
        meta = pod["metadata"]
        out.append(LostPod(meta["name"], meta.get("uid", ""), name or "", why, since,
                           bool(meta.get("deletionTimestamp")), due))
    return out
