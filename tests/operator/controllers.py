"""The controllers a real cluster runs that the emulator lacks, as small loops over its objects:
the garbage collector, the StatefulSet and Job controllers and the scheduler.

- garbage collection: objects whose owner (by uid) is gone are deleted;
- StatefulSet: pods from the template, one per ordinal; OnDelete, or RollingUpdate by the operator's
  template hash as the real controller rolls (highest ordinal first, at most `maxUnavailable` pods
  unavailable, a replacement Running and Ready before the next stale pod goes); pods become
  Running/Ready through `ready_when(pod)` once scheduled (default: at once; the e2e's local kubelet
  reports readiness itself, from the readiness probe's path);
- Job: one pod at a time from the template, `backoffLimit` retries, `podFailurePolicy` FailJob on
  exit codes, and the Complete/Failed conditions, stamped as the Job controller does (`startTime`,
  the conditions' `lastTransitionTime`, `completionTime` when Complete: how long ago a Job finished
  is what the operator retries a failed fetch by);
- scheduler: a pending pod goes to the first node (by name) that matches its nodeSelector and
  required node affinity (labels and `metadata.name` fields), has no NoSchedule/NoExecute taint the
  pod does not tolerate, holds no pod its required anti-affinity excludes, and has the extended
  resources it requests; else the pod gets `PodScheduled=False` reason Unschedulable with a message
  in the scheduler's words;
- lost nodes (`NodeLifecycle`): the pods of a node whose Ready condition is not True are marked not
  ready (the node lifecycle controller), a NoExecute taint they do not tolerate deletes them (the
  taint manager; the emulator keeps them Terminating: no kubelet confirms), the out-of-service taint
  force-deletes the terminating ones (the pod garbage collector), and once the node is Ready again
  its kubelet confirms them (force delete).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Callable
from typing import Any

from dlo.operator import builders
from dlo.operator.kube import _path
try:  # by name in the tests (conftest.py), as a package in the fleet benchmark (see cluster.py)
    from emulator import HELD, Emulator, live_objects, node_ready, now
except ImportError:
    from tests.operator.emulator import HELD, Emulator, live_objects, node_ready, now


async def request(emulator: Emulator, method: str, path: str, body: Any = None) -> None:
    headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
    async with emulator.request(method, path, json=body, headers=headers) as resp:
        assert resp.status < 300 or resp.status == 404, await resp.text()


def _of_kind(emulator: Emulator, kind: str) -> list[dict[str, Any]]:
    return [o for o in live_objects(emulator) if o.get("kind") == kind]


def owned_by(emulator: Emulator, owner: dict[str, Any], kind: str = "Pod") -> list[dict[str, Any]]:
    uid = owner["metadata"]["uid"]
    return [o for o in _of_kind(emulator, kind)
            if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences", []))]


def pod_path(pod: dict[str, Any]) -> str:
    return _path("v1", "Pod", pod["metadata"]["namespace"], pod["metadata"]["name"])


async def collect_garbage(emulator: Emulator) -> None:
    """Delete every object whose controller owner no longer exists (the garbage collector)."""
    while True:
        uids = {o["metadata"].get("uid") for o in live_objects(emulator)}
        for obj in live_objects(emulator):
            refs = obj["metadata"].get("ownerReferences") or []
            if refs and not any(r.get("uid") in uids for r in refs):
                meta = obj["metadata"]
                await request(emulator, "DELETE", _path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"]))
        await asyncio.sleep(0.1)


def _owner_ref(owner: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"], "controller": True}


def new_pod(owner: dict[str, Any], template: dict[str, Any], name: str, labels: dict[str, str] | None = None) -> dict:
    template = json.loads(json.dumps(template))
    meta = template.setdefault("metadata", {})
    meta.update(name=name, namespace=owner["metadata"]["namespace"], ownerReferences=[_owner_ref(owner)])
    meta["labels"] = {**meta.get("labels", {}), **(labels or {})}
    meta.setdefault("annotations", {})
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"],
            "status": {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}]}}


def healthy(pod: dict[str, Any]) -> bool:
    """Running and Ready and not terminating: what the StatefulSet controller waits for."""
    st = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in st.get("conditions") or [])
    return st.get("phase") == "Running" and ready and not pod["metadata"].get("deletionTimestamp")


def max_unavailable(sts: dict[str, Any]) -> int:
    """`rollingUpdate.maxUnavailable` as a pod count: a percentage of replicas rounded up, at least 1."""
    value = ((sts["spec"]["updateStrategy"].get("rollingUpdate") or {}).get("maxUnavailable", 1))
    if isinstance(value, str):
        value = -(-int(value.rstrip("%")) * sts["spec"]["replicas"] // 100)
    return max(1, int(value))


class StatefulSetController:
    """Pods from the template, one per ordinal (podManagementPolicy Parallel: created and removed
    together). RollingUpdate as the real controller does it: while fewer than maxUnavailable pods of
    the range are unavailable (missing, not Running and Ready, or terminating), delete stale pods from
    the highest ordinal down, up to the difference; a replacement must be ready before the next goes."""

    def __init__(self, emulator: Emulator, ready_when: Callable[[dict], bool] | None = None) -> None:
        self.emulator = emulator
        self.ready_when = ready_when or (lambda pod: True)

    async def step(self) -> None:
        for sts in _of_kind(self.emulator, "StatefulSet"):
            meta, spec = sts["metadata"], sts["spec"]
            pods = {p["metadata"]["name"]: p for p in owned_by(self.emulator, sts)}
            for name, pod in list(pods.items()):
                if int(name.rsplit("-", 1)[1]) >= spec["replicas"]:
                    if not pod["metadata"].get("deletionTimestamp"):
                        await request(self.emulator, "DELETE", pod_path(pod))
                    pods.pop(name)
            for i in range(spec["replicas"]):
                name = f"{meta['name']}-{i}"
                pod = pods.get(name)
                if pod is None:
                    body = new_pod(sts, spec["template"], name)
                    body["spec"]["hostname"] = name
                    await request(self.emulator, "POST", _path("v1", "Pod", meta["namespace"]), body)
                elif pod["spec"].get("nodeName") and self.ready_when(pod) and pod["status"].get("phase") != "Running":
                    status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
                    await request(self.emulator, "PATCH", pod_path(pod), {"status": status})
            if spec["updateStrategy"]["type"] == "RollingUpdate":
                await self._roll(sts, pods)

    async def _roll(self, sts: dict[str, Any], pods: dict[str, dict[str, Any]]) -> None:
        spec = sts["spec"]
        want = spec["template"]["metadata"]["annotations"][builders.TEMPLATE_HASH]
        names = [f"{sts['metadata']['name']}-{i}" for i in range(spec["replicas"])]
        unavailable = sum(1 for n in names if n not in pods or not healthy(pods[n]))
        budget = max_unavailable(sts) - unavailable
        partition = (spec["updateStrategy"].get("rollingUpdate") or {}).get("partition", 0)
        for name in reversed(names[partition:]):
            if budget <= 0:
                return
            pod = pods.get(name)
            if pod is None or pod["metadata"].get("deletionTimestamp"):
                continue
            if pod["metadata"]["annotations"].get(builders.TEMPLATE_HASH) != want:
                await request(self.emulator, "DELETE", pod_path(pod))
                budget -= 1

    async def run(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(0.1)


class JobController:
    async def step(self, emulator: Emulator) -> None:
        for job in _of_kind(emulator, "Job"):
            if any(c.get("status") == "True" for c in (job.get("status") or {}).get("conditions", [])):
                continue
            pods = owned_by(emulator, job)
            active = [p for p in pods if p["status"].get("phase") not in ("Succeeded", "Failed")]
            failed = [p for p in pods if p["status"].get("phase") == "Failed"]
            done = [p for p in pods if p["status"].get("phase") == "Succeeded"]
            path = _path("batch/v1", "Job", job["metadata"]["namespace"], job["metadata"]["name"])
            verdict = self._verdict(job, done, failed)
            if verdict is not None:
                stamp = now()
                status = {"succeeded": len(done), "failed": len(failed), "active": 0,
                          "conditions": [{"type": verdict[0], "status": "True", "reason": verdict[1],
                                          "lastTransitionTime": stamp}]}
                if verdict[0] == "Complete":
                    status["completionTime"] = stamp
                await request(emulator, "PATCH", path + "/status", {"status": status})
            elif not active:
                name = f"{job['metadata']['name']}-{uuid.uuid4().hex[:5]}"
                body = new_pod(job, job["spec"]["template"], name, {"job-name": job["metadata"]["name"]})
                await request(emulator, "POST", _path("v1", "Pod", job["metadata"]["namespace"]), body)
                status = {"active": 1, "failed": len(failed)}
                if not (job.get("status") or {}).get("startTime"):
                    status["startTime"] = now()
                await request(emulator, "PATCH", path + "/status", {"status": status})

    @staticmethod
    def _verdict(job: dict[str, Any], done: list[dict], failed: list[dict]) -> tuple[str, str] | None:
        if done:
            return ("Complete", "Completed")
        rules = (job["spec"].get("podFailurePolicy") or {}).get("rules", [])
        codes = {c for r in rules if r.get("action") == "FailJob" for c in r["onExitCodes"]["values"]}
        for pod in failed:
            for cs in pod["status"].get("containerStatuses", []):
                if (cs.get("state", {}).get("terminated") or {}).get("exitCode") in codes:
                    return ("Failed", "PodFailurePolicy")
        if len(failed) > job["spec"].get("backoffLimit", 6):
            return ("Failed", "BackoffLimitExceeded")
        return None

    async def run(self, emulator: Emulator) -> None:
        while True:
            await self.step(emulator)
            await asyncio.sleep(0.1)


def _term_matches(term: dict[str, Any], node: dict[str, Any]) -> bool:
    labels = node["metadata"].get("labels") or {}
    for expr in term.get("matchExpressions", []):
        op, key, values = expr["operator"], expr["key"], expr.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    for expr in term.get("matchFields", []):
        if expr["key"] == "metadata.name" and (node["metadata"]["name"] in expr["values"]) != (expr["operator"] == "In"):
            return False
    return True


def _requests(pod: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in pod["spec"].get("containers", []):
        for k, v in ((c.get("resources") or {}).get("limits") or {}).items():
            if "/" in k:  # extended resources (accelerators): whole numbers
                out[k] = out.get(k, 0) + int(v)
    return out


def tolerates(pod: dict[str, Any], taint: dict[str, Any]) -> bool:
    for t in pod["spec"].get("tolerations") or []:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t["key"] == taint.get("key")):
            return True
        if t.get("key") == taint.get("key") and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def untolerated(pod: dict[str, Any], node: dict[str, Any], effects: tuple[str, ...]) -> list[dict[str, Any]]:
    return [t for t in (node.get("spec") or {}).get("taints") or []
            if t.get("effect") in effects and not tolerates(pod, t)]


class NodeLifecycle:
    """What happens to the pods of a lost node (see the module's notes)."""

    async def step(self, emulator: Emulator) -> None:
        nodes = {n["metadata"]["name"]: n for n in _of_kind(emulator, "Node")}
        for pod in _of_kind(emulator, "Pod"):
            node = nodes.get(pod["spec"].get("nodeName") or "")
            if node is None:
                continue
            held = HELD in (pod["metadata"].get("finalizers") or [])
            if node_ready(node):
                if held:  # the kubelet is back and confirms the deletion
                    await request(emulator, "DELETE", pod_path(pod), {"gracePeriodSeconds": 0})
                continue
            if held:
                if any(t.get("key") == "node.kubernetes.io/out-of-service" for t in untolerated(pod, node, ("NoExecute",))):
                    await request(emulator, "DELETE", pod_path(pod), {"gracePeriodSeconds": 0})  # pod GC
                continue
            ready = next((c for c in pod["status"].get("conditions") or [] if c.get("type") == "Ready"), {})
            if ready.get("status") == "True":
                await request(emulator, "PATCH", pod_path(pod), {"status": {"conditions": [
                    {"type": "Ready", "status": "False", "reason": "NodeLost"}]}})
            elif untolerated(pod, node, ("NoExecute",)):
                await request(emulator, "DELETE", pod_path(pod))  # the taint manager evicts: stays Terminating

    async def run(self, emulator: Emulator) -> None:
        while True:
            await self.step(emulator)
            await asyncio.sleep(0.1)


class Scheduler:
    def reasons(self, pod: dict[str, Any], node: dict[str, Any], placed: list[dict[str, Any]]) -> str | None:
        """Why `pod` cannot go to `node` (the scheduler's words), or None when it can."""
        spec = pod["spec"]
        labels = node["metadata"].get("labels") or {}
        affinity = spec.get("affinity") or {}
        required = ((affinity.get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution")
                    or {}).get("nodeSelectorTerms")
        if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()) or (
                required and not any(_term_matches(t, node) for t in required)):
            return "node(s) didn't match Pod's node affinity/selector"
        if taints := untolerated(pod, node, ("NoSchedule", "NoExecute")):
            return "node(s) had untolerated taint {" + ", ".join(f"{t['key']}: {t.get('value', '')}" for t in taints) + "}"
        here = [p for p in placed if p["spec"].get("nodeName") == node["metadata"]["name"]]
        for term in (affinity.get("podAntiAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution", []):
            want = term["labelSelector"]["matchLabels"]
            if any(all((p["metadata"].get("labels") or {}).get(k) == v for k, v in want.items()) for p in here):
                return "node(s) didn't match pod anti-affinity rules"
        allocatable = (node.get("status") or {}).get("allocatable") or {}
        for res, n in _requests(pod).items():
            if int(allocatable.get(res, 0)) < n + sum(_requests(p).get(res, 0) for p in here):
                return f"Insufficient {res}"
        return None

    async def step(self, emulator: Emulator) -> None:
        nodes = sorted(_of_kind(emulator, "Node"), key=lambda n: n["metadata"]["name"])
        pods = [json.loads(json.dumps(p)) for p in _of_kind(emulator, "Pod") if not p["metadata"].get("deletionTimestamp")]
        placed = [p for p in pods if p["spec"].get("nodeName")]
        for pod in sorted((p for p in pods if not p["spec"].get("nodeName")), key=lambda p: p["metadata"]["name"]):
            why = {n["metadata"]["name"]: self.reasons(pod, n, placed) for n in nodes}
            fits = [name for name, reason in why.items() if reason is None]
            if fits:
                pod["spec"]["nodeName"] = fits[0]
                placed.append(pod)
                await request(emulator, "PATCH", pod_path(pod), {"spec": {"nodeName": fits[0]}, "status": {
                    "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "False"}]}})
                continue
            counts: dict[str, int] = {}
            for reason in why.values():
                counts[reason] = counts.get(reason, 0) + 1  # type: ignore[index]
            message = f"0/{len(nodes)} nodes are available: " + ", ".join(f"{n} {r}" for r, n in sorted(counts.items())) + "."
            cond = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}
            if cond not in pod["status"].get("conditions", []):
                await request(emulator, "PATCH", pod_path(pod), {"status": {"conditions": [
                    cond, {"type": "Ready", "status": "False"}]}})

    async def run(self, emulator: Emulator) -> None:
        while True:
            await self.step(emulator)
            await asyncio.sleep(0.1)
