"""kopf wiring for DLODeployment: watches, indexes and one reconcile loop per resource.

Owns: `registry(config)`, the kopf registry `dlo operator run` and the tests start: startup
settings, the node index (`node_index`: summaries kept from the node watch, replaced only on a
change), kopf's indexes of the dlo pods (engine and fetch), the StatefulSets and the fetch Jobs (no
reconcile lists or gets them), event handlers that wake the reconcile of the DLODeployment a change
concerns (its spec, its pods, its StatefulSet's spec, its Jobs; a node's change only those it
matches or runs a pod on, a heartbeat none), the
start and end of each resource's loop (`loops`: no kopf daemon, so no finalizer; kopf's finalizer of
earlier versions is removed), and the round it runs: `reconcile.run` over what the indexes hold.
Must never: build manifests or decide anything itself (`reconcile`, `builders`, `modes`,
`delivery`), block the event loop (the reconcile runs in a thread), copy the inventory per round, or
import torch.
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
from dlo.operator.kube import Kube, KubeError
from dlo.operator.loops import Key, Loops, Round
from dlo.operator.node_index import NodeIndex
from dlo.operator.models import API_VERSION, GROUP, KIND, PLURAL, VERSION
from dlo.operator.reconcile import View, run

log = logging.getLogger(__name__)
RESOURCE = (GROUP, VERSION, PLURAL)
NODE_FIELDS = ("labels", "annotations")
KOPF_FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"  # what kopf's daemon of earlier versions added


def plain(value: Any) -> Any:
    """A deep copy of kopf's mapping views as plain dicts and lists (safe to hand to a thread)."""
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


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
    loops = Loops(config)
    node_index = NodeIndex()

    @kopf.on.startup(id="configure", registry=reg)
    def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        # Keep kopf's bookkeeping in annotations: our status schema has no room for it.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
        settings.posting.level = logging.INFO
        settings.watching.server_timeout = 300
        if getattr(memo, "kube", None) is None:
            memo.kube = Kube.from_environment()
        memo.loops, memo.node_index = loops, node_index  # what the rounds and node events did (tests)

    @kopf.on.cleanup(id="stop_loops", registry=reg)
    async def stop_loops(**_: Any) -> None:
        await loops.stop()

    _watch_nodes(reg, loops, node_index)
    _watch_children(reg, loops)

    @kopf.on.event(*RESOURCE, id="observe", registry=reg)
    async def observe(event: kopf.RawEvent, memo: kopf.Memo, dlo_pods: kopf.Index, fetch_jobs: kopf.Index,
                      statefulsets: kopf.Index, **_: Any) -> None:
        """Start a resource's loop on its first event and wake it when its spec changes (its
        generation); end it when the resource is deleted."""
        obj = event["object"]
        meta = obj["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        if loops.round is None:
            loops.round = _round(memo, config, node_index, dlo_pods, fetch_jobs, statefulsets)
        if event.get("type") == "DELETED":
            metrics.CONDITIONS.forget(*key)
            metrics.FETCHES.forget(*key)
            node_index.forget(key)
            await loops.forget(key)
            return
        node_index.select(key, obj.get("spec") or {})
        if KOPF_FINALIZER in (meta.get("finalizers") or []):
            await asyncio.to_thread(_drop_kopf_finalizer, memo.kube, key, list(meta["finalizers"]))
        loops.seen(key, plain(obj))

    return reg


def _watch_nodes(reg: kopf.OperatorRegistry, loops: Loops, node_index: NodeIndex) -> None:
    """The node index (kopf's, pre-filled at start) and the wakes a node's change causes."""
    @kopf.index("v1", "nodes", id="nodes", registry=reg)
    def nodes(name: str, body: kopf.Body, **_: Any) -> dict[str, Any]:
        """kopf runs every index before any other handler, and at start lists every node into them
        before the first reconcile: the node index is kept here, its change left for node_changed."""
        node_index.record(name, _node_summary(body))
        return {name: node_index.nodes[name]}

    @kopf.on.event("v1", "nodes", id="node_changed", registry=reg)
    def node_changed(event: kopf.RawEvent, name: str, body: kopf.Body, dlo_pods: kopf.Index, **_: Any) -> None:
        """A node's change wakes the DLODeployments it concerns; a heartbeat is no change."""
        change = node_index.update(name, None) if event.get("type") == "DELETED" else node_index.changed(name)
        if change is not None:
            for key in node_index.concerned(name, change, dlo_pods.items()):
                loops.wake(key)


def _watch_children(reg: kopf.OperatorRegistry, loops: Loops) -> None:
    """kopf's indexes of the dlo pods, StatefulSets and fetch Jobs, and the wakes their changes cause."""
    dlo_labels = {PART_OF: "dlo"}
    statefulset_generations: dict[Key, Any] = {}
    child_versions: dict[str, Any] = {}  # a pod's or fetch Job's uid -> its resourceVersion last seen

    @kopf.index("v1", "pods", labels=dlo_labels, id="dlo_pods", registry=reg)
    def dlo_pods(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return {(namespace, _owner_of(labels)): plain(body)}

    @kopf.index("apps", "v1", "statefulsets", labels=dlo_labels, id="statefulsets", registry=reg)
    def statefulsets(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return {(namespace, _owner_of(labels)): plain(body)}

    @kopf.on.event("apps", "v1", "statefulsets", labels=dlo_labels, id="statefulset_changed", registry=reg)
    def statefulset_changed(event: kopf.RawEvent, namespace: str, labels: kopf.Labels, **_: Any) -> None:
        """Someone else changed (or deleted) a StatefulSet's spec: its owner applies its own again."""
        key = (namespace, _owner_of(labels) or "")
        generation = (event["object"].get("metadata") or {}).get("generation")
        if event.get("type") == "DELETED" or statefulset_generations.get(key) != generation:
            statefulset_generations[key] = generation
            loops.wake(key)

    @kopf.index("batch", "v1", "jobs", labels={**dlo_labels, COMPONENT: "fetch"}, id="fetch_jobs", registry=reg)
    def fetch_jobs(namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return {(namespace, _owner_of(labels)): plain(body)}

    @kopf.on.event("v1", "pods", labels=dlo_labels, id="pod_changed", registry=reg)
    @kopf.on.event("batch", "v1", "jobs", labels={**dlo_labels, COMPONENT: "fetch"}, id="job_changed", registry=reg)
    def child_changed(event: kopf.RawEvent, namespace: str, labels: kopf.Labels, **_: Any) -> None:
        """A pod or Job that changed wakes its owner; one seen already (kopf lists every object
        again when a watch restarts) does not."""
        owner = _owner_of(labels)
        meta = event["object"].get("metadata") or {}
        if event.get("type") == "DELETED":
            child_versions.pop(meta.get("uid", ""), None)
        elif child_versions.get(meta.get("uid", "")) == meta.get("resourceVersion"):
            return
        else:
            child_versions[meta.get("uid", "")] = meta.get("resourceVersion")
        if namespace and owner:
            loops.wake((namespace, owner))


def _round(memo: kopf.Memo, config: OperatorConfig, nodes: NodeIndex, dlo_pods: kopf.Index,
           fetch_jobs: kopf.Index, statefulsets: kopf.Index) -> Round:
    """One reconcile of a resource over what the indexes hold (live: read at each round; the
    summaries and pods themselves, not copies: they are replaced on change, never changed)."""
    async def reconcile_once(key: Key, body: dict[str, Any]) -> bool:
        view = View(nodes=nodes.values(),
                    pods=[p for p in dlo_pods.get(key, [])],
                    all_pods=[p for store in dlo_pods.values() for p in store],
                    jobs=[j for j in fetch_jobs.get(key, [])],
                    all_jobs=[j for store in fetch_jobs.values() for j in store],
                    statefulset=next(iter(statefulsets.get(key, [])), None))
        return await asyncio.to_thread(run, memo.kube, body, view, config)
    return reconcile_once


def _drop_kopf_finalizer(kube: Kube, key: Key, finalizers: list[str]) -> None:
    """The finalizer kopf added for the daemon of earlier versions: nothing needs it now, and it
    would make a deletion wait on a running operator."""
    try:
        kube.remove_finalizer(API_VERSION, KIND, key[0], key[1], KOPF_FINALIZER, finalizers)
        log.info("removed kopf's finalizer resource=%s/%s", *key)
    except KubeError as e:
        log.warning("could not remove kopf's finalizer resource=%s/%s: %s", *key, e)
