"""kopf wiring for DLODeployment: watches, indexes and one reconcile loop per resource.

Owns: `registry(config)`, the kopf registry `dlo operator run` and the tests start: startup
settings, indexes of the nodes, of the dlo pods (engine and fetch) and of the fetch Jobs (kept by
kopf from watch streams: no reconcile lists them), event handlers that wake the reconcile of the
DLODeployment a change concerns (its spec, its pods, its Jobs; every one for a node change), and a
daemon per DLODeployment that runs `reconcile.run` when woken, or after `status_interval` when
nothing changed (a resync), and after `retry_seconds` when a round failed.
Must never: build manifests or decide anything itself (`reconcile`, `builders`, `modes`,
`delivery`), block the event loop (the reconcile runs in a thread, on a copy of what the indexes
hold), or import torch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import kopf

from dlo.operator import metrics, node_loss
from dlo.operator.builders import COMPONENT, INSTANCE, PART_OF
from dlo.operator.config import OperatorConfig
from dlo.operator.kube import Kube
from dlo.operator.models import GROUP, PLURAL, VERSION
from dlo.operator.reconcile import View, run

log = logging.getLogger(__name__)
RESOURCE = (GROUP, VERSION, PLURAL)
NODE_FIELDS = ("labels", "annotations")
WAIT_POLL_S = 0.5  # how often a waiting reconcile loop looks at its stop flag


def plain(value: Any) -> Any:
    """A deep copy of kopf's mapping views as plain dicts and lists (safe to hand to a thread)."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


class Wakeups:
    """One asyncio.Event per DLODeployment, set by the watch handlers, awaited by its loop."""

    def __init__(self) -> None:
        self._events: dict[tuple[str, str], asyncio.Event] = {}
        self.generations: dict[tuple[str, str], Any] = {}

    def event(self, namespace: str, name: str) -> asyncio.Event:
        return self._events.setdefault((namespace, name), asyncio.Event())

    def wake(self, namespace: str | None, name: str | None) -> None:
        if namespace and name:
            self.event(namespace, name).set()

    def wake_all(self) -> None:
        for event in self._events.values():
            event.set()

    def forget(self, namespace: str, name: str) -> None:
        self._events.pop((namespace, name), None)
        self.generations.pop((namespace, name), None)


def _node_summary(body: Mapping[str, Any]) -> dict[str, Any]:
    """What the operator reads of a node: labels, annotations, schedulable, allocatable, its Ready
    condition and taints (`node_loss`); never heartbeat times."""
    meta = body.get("metadata", {})
    loss = node_loss.node_summary_fields(body)
    out = {"metadata": {"name": meta.get("name"), **{k: plain(meta.get(k) or {}) for k in NODE_FIELDS}},
           "spec": {"unschedulable": (body.get("spec") or {}).get("unschedulable", False), "taints": loss["taints"]},
           "status": {"allocatable": plain((body.get("status") or {}).get("allocatable") or {})}}
    if "ready" in loss:
        out["status"]["ready"] = loss["ready"]
    return out


def _owner_of(labels: Mapping[str, str]) -> str | None:
    return labels.get(INSTANCE)


def registry(config: OperatorConfig, login: bool = True) -> kopf.OperatorRegistry:
    """A kopf registry with every handler of the operator, configured by `config`; `login`: log in
    as the kubernetes client does (service account, else kubeconfig), or leave it to the caller."""
    reg = kopf.OperatorRegistry()
    if login:
        kopf.on.login(id="login", registry=reg)(kopf.login_via_client)
    wakeups = Wakeups()
    dlo_labels = {PART_OF: "dlo"}

    @kopf.on.startup(id="configure", registry=reg)
    def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        # Keep kopf's bookkeeping in annotations: our status schema has no room for it.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
        settings.posting.level = logging.INFO
        settings.watching.server_timeout = 300
        if getattr(memo, "kube", None) is None:
            memo.kube = Kube.from_environment()

    @kopf.index("v1", "nodes", id="nodes", registry=reg)
    def nodes(name: str, body: kopf.Body, **_: Any) -> dict[str, Any]:
        return {name: _node_summary(body)}

    @kopf.index("v1", "pods", labels=dlo_labels, id="dlo_pods", registry=reg)
    def dlo_pods(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return {(namespace, _owner_of(labels)): plain(body)}

    @kopf.index("batch", "v1", "jobs", labels={**dlo_labels, COMPONENT: "fetch"}, id="fetch_jobs", registry=reg)
    def fetch_jobs(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return {(namespace, _owner_of(labels)): plain(body)}

    @kopf.on.event("v1", "pods", labels=dlo_labels, id="pod_changed", registry=reg)
    @kopf.on.event("batch", "v1", "jobs", labels={**dlo_labels, COMPONENT: "fetch"}, id="job_changed", registry=reg)
    def child_changed(namespace: str, labels: kopf.Labels, **_: Any) -> None:
        wakeups.wake(namespace, _owner_of(labels))

    @kopf.on.event("v1", "nodes", id="node_changed", registry=reg)
    def node_changed(event: kopf.RawEvent, **_: Any) -> None:
        wakeups.wake_all()  # a node's labels, profile or capacity change what any resource may do

    @kopf.on.event(*RESOURCE, id="observe", registry=reg)
    def observe(event: kopf.RawEvent, **_: Any) -> None:
        """Wake a resource's loop when its spec changes (its generation), and forget a deleted one."""
        meta = event["object"]["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        if event.get("type") == "DELETED":
            metrics.CONDITIONS.forget(*key)
            metrics.FETCHES.forget(*key)
            wakeups.forget(*key)
        elif wakeups.generations.get(key) != meta.get("generation"):
            wakeups.generations[key] = meta.get("generation")
            wakeups.wake(*key)

    @kopf.daemon(*RESOURCE, id="reconcile", registry=reg, cancellation_polling=WAIT_POLL_S)
    async def reconcile_loop(name: str, namespace: str, body: kopf.Body, stopped: kopf.DaemonStopped,
                             memo: kopf.Memo, nodes: kopf.Index, dlo_pods: kopf.Index, fetch_jobs: kopf.Index,
                             **_: Any) -> None:
        wake = wakeups.event(namespace, name)
        while not stopped:
            wake.clear()
            view = View(nodes=[plain(n) for store in nodes.values() for n in store],
                        pods=[p for p in dlo_pods.get((namespace, name), [])],
                        all_pods=[p for store in dlo_pods.values() for p in store],
                        jobs=[j for j in fetch_jobs.get((namespace, name), [])],
                        all_jobs=[j for store in fetch_jobs.values() for j in store])
            ok = await asyncio.to_thread(run, memo.kube, plain(body), view, config)
            delay = config.status_interval if ok else config.retry_seconds
            await _sleep_until_woken(wake, stopped, delay)

    return reg


async def _sleep_until_woken(wake: asyncio.Event, stopped: kopf.DaemonStopped, delay: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + delay
    while not stopped and not wake.is_set():
        left = deadline - loop.time()
        if left <= 0:
            return
        try:
            await asyncio.wait_for(wake.wait(), timeout=min(left, WAIT_POLL_S))
        except TimeoutError:
            continue
