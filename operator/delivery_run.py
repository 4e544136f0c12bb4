"""The reconcile's model-delivery step: gather what `model_delivery.plan_delivery` needs (the model
and adapters the pods run, fetch progress from the Jobs' logs, the fetch slots in use), carry its plan
out for each fetched source (node labels, fetch Jobs created and deleted, an Event each) and count it
in `metrics`.

Owns: `deliver`.
Must never: decide (that is `model_delivery`), read a Secret, or write to a node but its
`model.dlo.dev/*` labels.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

import kopf

from dlo.delivery.progress import parse_progress_line
from dlo.operator import metrics
from dlo.operator.config import OperatorConfig
from dlo.operator.fetch_builder import build_fetch_job
from dlo.operator.kube import Kube
from dlo.operator.model_delivery import (DeliveryInputs, DeliveryPlan, job_state, keys_in_use, node_label_patch,
                                         plan_delivery)
from dlo.operator.model_spec import ModelSource
from dlo.operator.models import DLODeploymentSpec
from dlo.operator.names import (COMPONENT, FETCH_NODE_ANNOTATION, LORA_SOURCE_ANNOTATION, MODEL_KEY_ANNOTATION,
                                MODEL_SOURCE_ANNOTATION, BuildContext, Owner)
from dlo.operator.pod_builder import engine_image
from dlo.operator.pod_spec import LoraSource

log = logging.getLogger(__name__)


def _served(kube: Kube, owner: Owner, sts: dict[str, Any] | None) -> tuple[ModelSource | None, LoraSource | None]:
    """The `spec.model` and `spec.lora` the StatefulSet's pods run now (None before there is one):
    from the watch's StatefulSet (`sts`), else read."""
    if sts is None:
        sts = kube.get("apps/v1", "StatefulSet", owner.namespace, owner.name)
    annotations = (sts or {}).get("metadata", {}).get("annotations") or {}
    return (_read(ModelSource, annotations.get(MODEL_SOURCE_ANNOTATION)),
            _read(LoraSource, annotations.get(LORA_SOURCE_ANNOTATION)))


def _read(kind: Any, raw: str | None) -> Any:
    if not raw:
        return None
    try:
        return kind.model_validate_json(raw)
    except ValueError:
        return None


def _finished_at(job: dict[str, Any]) -> float:
    """When a finished Job ended: its completion or a condition's transition, else its creation (a
    Job with no time of its own is retried after the back-off from then, never held back for good)."""
    st = job.get("status") or {}
    stamps = [st.get("completionTime")] + [c.get("lastTransitionTime") for c in st.get("conditions") or []]
    stamps.append((job.get("metadata") or {}).get("creationTimestamp"))
    for stamp in stamps:
        if stamp:
            try:
                return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return time.time()


def _active_fetches(all_jobs: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {"": 0}
    for job in all_jobs:
        if job_state(job) == "active":
            node = (job["metadata"].get("annotations") or {}).get(FETCH_NODE_ANNOTATION, "")
            out[node] = out.get(node, 0) + 1
            out[""] += 1
    return out


def _progress_reader(kube: Kube, fetch_pods: list[dict[str, Any]]) -> Any:
    def progress_of(job: dict[str, Any]) -> tuple[int, int, int, int] | None:
        name = job["metadata"]["name"]
        running = [p for p in fetch_pods if (p["metadata"].get("labels") or {}).get("job-name") == name
                   and (p.get("status") or {}).get("phase") in ("Running", "Pending")]
        if not running:
            return None
        pod = running[-1]["metadata"]
        progress = parse_progress_line(kube.pod_log(pod["namespace"], pod["name"], "fetch", tail_lines=5))
        key = (job["metadata"].get("annotations") or {}).get(MODEL_KEY_ANNOTATION, "")
        if progress is not None:
            metrics.FETCHES.progressed(job["metadata"].get("uid", name), key, progress[0])
        return progress
    return progress_of


def deliver(kube: Kube, body: dict[str, Any], owner: Owner, spec: DLODeploymentSpec, view: Any,
            config: OperatorConfig) -> DeliveryPlan | None:
    """Plan and carry out the delivery of `spec.model.uri` and `spec.lora.uri` (None when both are
    folders every node has)."""
    if spec.model.uri is None and (spec.lora is None or spec.lora.uri is None):
        metrics.FETCHES.forget(owner.namespace, owner.name)
        return None
    fetch_pods = [p for p in view.pods if (p["metadata"].get("labels") or {}).get(COMPONENT) == "fetch"]
    engine_nodes = [p["spec"]["nodeName"] for p in view.engine_pods() if (p.get("spec") or {}).get("nodeName")]
    served, served_lora = _served(kube, owner, view.statefulset)
    plan = plan_delivery(DeliveryInputs(
        spec=spec, served=served, served_lora=served_lora, nodes=view.nodes, engine_nodes=engine_nodes,
        jobs=view.jobs, fetch_pods=fetch_pods, active_elsewhere=_active_fetches(view.all_jobs),
        in_use=keys_in_use(view.all_pods), progress_of=_progress_reader(kube, fetch_pods), now=time.time(),
        max_fetches=config.max_fetches, retry_seconds=config.fetch_retry_seconds, finished_at=_finished_at))
    _carry_out(kube, body, owner, spec, plan, config)
    metrics.FETCHES.observe(owner.namespace, owner.name,
                            {sp.key: [st["state"] for st in sp.fetches.values()] for sp in plan.sources()})
    return plan


def _carry_out(kube: Kube, body: dict[str, Any], owner: Owner, spec: DLODeploymentSpec, plan: DeliveryPlan,
               config: OperatorConfig) -> None:
    for job, result in plan.completed:
        job_key = (job["metadata"].get("annotations") or {}).get(MODEL_KEY_ANNOTATION, "")
        metrics.FETCHES.finished(job["metadata"].get("uid", job["metadata"]["name"]), job_key,
                                 int(result.get("downloaded_bytes") or 0))
    for sp in plan.sources():
        what = f"{sp.source.what}{sp.source.uri}"
        for node in sp.label:
            kube.patch("v1", "Node", None, node, node_label_patch(sp.key, True))
            kopf.info(body, reason="ModelFetched", message=f"node {node} holds {what}")
    for node, evicted in plan.unlabel:
        kube.patch("v1", "Node", None, node, node_label_patch(evicted, False))
        kopf.info(body, reason="ModelEvicted", message=f"a fetch on node {node} evicted {evicted}")
    for job in plan.delete:
        kube.delete("batch/v1", "Job", owner.namespace, job["metadata"]["name"], propagation="Background")
    ctx = BuildContext(cache_root=config.cache_root, fetch=config.fetch, log_format=config.log_format)
    for sp in plan.sources():
        budget = config.cache_disk_budget if sp is plan.model else None  # the budget is the models' own
        for node in sp.start:
            job = build_fetch_job(owner, spec, node, plan.keep.get(node, []), ctx, budget, engine_image(spec),
                                  source=sp.source)
            kopf.append_owner_reference(job, owner=body)
            if kube.create_once(job):
                kopf.info(body, reason="FetchStarted",
                          message=f"fetching {sp.source.what}{sp.source.uri} onto node {node}")
