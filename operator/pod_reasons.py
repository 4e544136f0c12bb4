"""Why engine pods are not ready, in the words of the scheduler and the kubelet (as KServe's
`lastFailureInfo`): the reasons the Ready and Progressing conditions give.

Owns: `Problem`, `pod_problems` (Unschedulable from the PodScheduled condition, ImagePullBackOff from
a waiting container, FailedMount from the pod's events, Warming while the warmer init container
runs), the order of precedence when several pods differ (NodeLost, found by `node_loss`, first), and
`mount_pending` (the pods whose events are worth a look).
Must never: call the API server itself (the events come through the function it is given).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

IMAGE_PULL = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull")
PRECEDENCE = ("NodeLost", "ImagePullBackOff", "FailedMount", "Unschedulable", "Warming")


@dataclass(frozen=True)
class Problem:
    reason: str  # one of PRECEDENCE
    pod: str
    message: str

    def line(self) -> str:
        return f"pod {self.pod}: {self.message}"


def _statuses(pod: dict[str, Any]) -> list[dict[str, Any]]:
    st = pod.get("status") or {}
    return (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or [])


def _unschedulable(pod: dict[str, Any]) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return c.get("message") or "the scheduler found no node"
    return None


def _image_pull(pod: dict[str, Any]) -> str | None:
    for cs in _statuses(pod):
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in IMAGE_PULL:
            return f"container {cs.get('name')}: {waiting['reason']}: {waiting.get('message') or cs.get('image', '')}"
    return None


def _warming(pod: dict[str, Any]) -> str | None:
    for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
        running = (cs.get("state") or {}).get("running")
        if cs.get("name") == "warm" and running is not None:
            since = running.get("startedAt")
            return "warming the page cache (init container warm running" + (f" since {since})" if since else ")")
    return None


def mount_pending(pod: dict[str, Any]) -> bool:
    """A scheduled pod whose containers have not started: a volume may be failing to mount."""
    st = pod.get("status") or {}
    if not (pod.get("spec") or {}).get("nodeName") or st.get("phase") not in (None, "Pending"):
        return False
    statuses = _statuses(pod)
    return not statuses or all(((cs.get("state") or {}).get("waiting") or {}).get("reason") in
                               (None, "ContainerCreating", "PodInitializing") for cs in statuses)


def pod_problems(pods: list[dict[str, Any]], events_of: Callable[[dict[str, Any]], list[dict[str, Any]]]) -> list[Problem]:
    """One problem per pod that has one (not ready pods only), most serious first."""
    out = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        if pod["metadata"].get("deletionTimestamp"):
            continue
        name = pod["metadata"]["name"]
        found = None
        if (msg := _image_pull(pod)) is not None:
            found = Problem("ImagePullBackOff", name, msg)
        elif (msg := _unschedulable(pod)) is not None:
            found = Problem("Unschedulable", name, msg)
        elif mount_pending(pod) and (mounts := [e for e in events_of(pod) if e.get("reason") == "FailedMount"]):
            last = max(mounts, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
            found = Problem("FailedMount", name, f"FailedMount: {last.get('message', '')}")
        elif (msg := _warming(pod)) is not None:
            found = Problem("Warming", name, msg)
        if found is not None:
            out.append(found)
    return sorted(out, key=lambda p: (PRECEDENCE.index(p.reason), p.pod))
