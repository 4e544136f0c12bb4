"""Model delivery for `spec.model.uri` and `spec.lora.uri`: which nodes hold what is fetched, which
must fetch it, which model and adapters the pods run while new ones are fetched, and what the status
says. Pure: the reconcile carries the plan out (creates and deletes fetch Jobs, labels nodes).

Owns: `plan_delivery` -> `DeliveryPlan` (one `SourcePlan` per fetched source: the model, the
adapters). A node holds a source completely when it carries the label `model.dlo.dev/<cache key>`
(set when a fetch Job for it succeeded there, or, for the model, when the node's profile lists the
folder; removed when a fetch reports it evicted). A node is ready for the pods when it holds every
source; when fewer eligible nodes are than `replicas`, more fetch what they lack: the nodes the pods
run on first, then those holding or fetching the most, then the others by name; one fetch per node
at a time (a node's second source waits, `pending`), at most `max_fetches` over every DLODeployment,
a failed one kept for `fetch_retry_seconds` (its reason in the status) and then tried again. A new
uri or revision (of the model or of the adapters) is fetched before the pods move to it: the
StatefulSet keeps the model and adapters its pods run (`dlo.dev/model-source`, `dlo.dev/lora-source`)
until enough nodes hold the new ones.
Must never: call the API server, read a Secret, or evict (only `dlo fetch` does, never a model in use).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dlo.plan.profile import NodeProfile
from dlo.operator import modes
from dlo.operator.model_spec import FetchedSource, ModelSource
from dlo.operator.models import DLODeploymentSpec
from dlo.operator.names import (COMPONENT, FETCH_NODE_ANNOTATION, LORA_KEY_ANNOTATION, MODEL_KEY_ANNOTATION,
                                MODEL_LABEL_PREFIX, model_label)
from dlo.operator.pod_spec import LoraSource

Progress = tuple[int, int, int, int]  # bytes, total, files done, files (the fetch's last progress line)
Verdict = tuple[str, str, str]


@dataclass
class SourcePlan:
    """The delivery of one fetched source (the model or the adapters) over the eligible nodes."""

    source: FetchedSource
    key: str
    fetches: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> NodeModelStatus fields
    start: list[str] = field(default_factory=list)  # nodes to start a fetch Job of it on
    label: list[str] = field(default_factory=list)  # nodes that now hold it
    holders: set[str] = field(default_factory=set)

    def state(self, node: str) -> str | None:
        """complete, fetching or failed on `node`; None: nothing yet (or only pending)."""
        if node in self.holders:
            return "complete"
        found = self.fetches.get(node, {}).get("state")
        return found if found in ("fetching", "failed") else None


@dataclass
class DeliveryPlan:
    pods_model: ModelSource  # what the StatefulSet's pods run
    pods_lora: LoraSource | None  # the adapters they run
    verdict: Verdict  # ModelReady
    model: SourcePlan | None = None  # model.uri
    lora: SourcePlan | None = None  # lora.uri
    delete: list[dict[str, Any]] = field(default_factory=list)  # Jobs done with (recorded, retried, stale)
    unlabel: list[tuple[str, str]] = field(default_factory=list)  # (node, key) evicted there
    keep: dict[str, list[str]] = field(default_factory=dict)  # node -> keys its pods use (never evicted)
    rolling_for_model: str = ""
    completed: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)  # (Job, its result)

    def sources(self) -> list[SourcePlan]:
        return [p for p in (self.model, self.lora) if p is not None]


def job_state(job: dict[str, Any]) -> str:
    """active, succeeded or failed (from the Job's conditions)."""
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("status") == "True" and c.get("type") in ("Complete", "Failed"):
            return "succeeded" if c["type"] == "Complete" else "failed"
    return "active"


def job_result(job: dict[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any]:
    """The result `dlo fetch` left in its last pod's termination message; a Job ended past its
    `activeDeadlineSeconds` (no result left) is a `timeout`; {} when none."""
    name = job["metadata"]["name"]
    mine = sorted((p for p in pods if (p["metadata"].get("labels") or {}).get("job-name") == name),
                  key=lambda p: p["metadata"].get("creationTimestamp") or "")
    for pod in reversed(mine):
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            message = ((cs.get("state") or {}).get("terminated") or {}).get("message")
            if message:
                try:
                    return dict(json.loads(message))
                except (ValueError, TypeError):
                    return {"state": "failed", "reason": "transfer", "message": message[:500]}
    for c in (job.get("status") or {}).get("conditions") or []:  # ended from outside: its pod left no result
        if c.get("type") == "Failed" and c.get("status") == "True" and c.get("reason") == "DeadlineExceeded":
            return {"state": "failed", "reason": "timeout", "message": str(c.get("message") or "")[:500]}
    return {}


def holds(node: dict[str, Any], key: str) -> bool:
    return (node["metadata"].get("labels") or {}).get(model_label(key)) == "true"


def _profile_lists(node: dict[str, Any], key: str) -> bool:
    raw = modes.node_profile_json(node)
    if raw is None:
        return False
    try:
        profile = NodeProfile.from_annotation(raw)
    except ValueError:
        return False
    return key in profile.models and key not in (profile.model_errors or {})


def keys_in_use(all_pods: list[dict[str, Any]]) -> dict[str, list[str]]:
    """node -> the cache keys its engine pods (of any DLODeployment) run: models and adapters."""
    out: dict[str, set[str]] = {}
    for pod in all_pods:
        meta = pod["metadata"]
        node = (pod.get("spec") or {}).get("nodeName")
        annotations = meta.get("annotations") or {}
        keys = {annotations.get(MODEL_KEY_ANNOTATION), annotations.get(LORA_KEY_ANNOTATION)} - {None}
        if node and keys and (meta.get("labels") or {}).get(COMPONENT) == "engine" and not meta.get("deletionTimestamp"):
            out.setdefault(node, set()).update(keys)  # type: ignore[arg-type]
    return {n: sorted(k) for n, k in out.items()}


def _status(state: str, progress: Progress | None = None, result: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"state": state}
    if progress is not None:
        done, total = progress[0], progress[1]
        out.update(bytes=done, totalBytes=total, percent=round(100.0 * done / total, 1) if total else 100.0)
    if result and result.get("bytes") is not None and state == "complete":
        out.update(bytes=result["bytes"], totalBytes=result["bytes"], percent=100.0)
    if result and state == "failed":
        out.update(reason=str(result.get("reason", "")), message=str(result.get("message", ""))[:500])
    return out


@dataclass
class DeliveryInputs:
    spec: DLODeploymentSpec
    served: ModelSource | None  # the model the StatefulSet's pods run (None: no StatefulSet yet)
    nodes: list[dict[str, Any]]
    engine_nodes: list[str]  # nodes this resource's engine pods run on
    jobs: list[dict[str, Any]]  # this resource's fetch Jobs
    fetch_pods: list[dict[str, Any]]
    active_elsewhere: dict[str, int]  # node -> active fetch Jobs of any resource; "" -> the total
    in_use: dict[str, list[str]]
    progress_of: Callable[[dict[str, Any]], Progress | None]
    now: float
    max_fetches: int
    retry_seconds: float
    finished_at: Callable[[dict[str, Any]], float]
    served_lora: LoraSource | None = None  # the adapters the StatefulSet's pods run


def plan_delivery(i: DeliveryInputs) -> DeliveryPlan:
    """What to do for one DLODeployment with a `model.uri` or a `lora.uri` (see the module docstring)."""
    spec = i.spec
    plan = DeliveryPlan(pods_model=spec.model, pods_lora=spec.lora, verdict=("Unknown", "Fetching", ""), keep=i.in_use)
    if spec.model.cache_key is not None:
        plan.model = SourcePlan(spec.model, spec.model.cache_key)
    if spec.lora is not None and spec.lora.cache_key is not None:
        plan.lora = SourcePlan(spec.lora, spec.lora.cache_key)
    eligible = {n["metadata"]["name"]: n for n in modes.eligible_nodes(i.nodes, spec)}
    for sp in plan.sources():
        sp.holders = {name for name, n in eligible.items() if holds(n, sp.key)}
        for name, node in eligible.items():
            if sp is plan.model and name not in sp.holders and _profile_lists(node, sp.key):  # fetched, or copied
                sp.holders.add(name)
                sp.label.append(name)
    _read_jobs(i, eligible, plan)
    for sp in plan.sources():
        for name in sp.holders:
            sp.fetches[name] = _status("complete")
    _choose_fetches(i, eligible, plan)
    _roll_or_hold(i, len(_ready_nodes(plan, eligible)), plan)
    plan.verdict = _verdict(spec.replicas, plan)
    return plan


def _ready_nodes(plan: DeliveryPlan, nodes: Any) -> set[str]:
    """The nodes that hold every fetched source."""
    return {n for n in nodes if all(sp.state(n) == "complete" for sp in plan.sources())}


def _read_jobs(i: DeliveryInputs, eligible: dict[str, Any], plan: DeliveryPlan) -> None:
    """Fold each fetch Job into the plan of its source (by its cache key)."""
    by_key = {sp.key: sp for sp in plan.sources()}
    served = {s.cache_key for s in (i.served, i.served_lora) if s is not None and s.cache_key}
    for job in i.jobs:
        annotations = job["metadata"].get("annotations") or {}
        node, job_key = annotations.get(FETCH_NODE_ANNOTATION, ""), annotations.get(MODEL_KEY_ANNOTATION, "")
        state, sp = job_state(job), by_key.get(job_key)
        if (sp is None and job_key not in served) or (node not in eligible and state == "active"):
            plan.delete.append(job)  # a source no longer wanted, or a node no longer usable
            continue
        if state == "active":
            if sp is not None:
                sp.fetches[node] = _status("fetching", i.progress_of(job))
            continue
        result = job_result(job, i.fetch_pods)
        for evicted in result.get("evicted") or []:
            plan.unlabel.append((node, str(evicted)))
        if state == "succeeded" and result.get("state") == "complete":
            plan.completed.append((job, result))
            if sp is not None and node in eligible and node not in sp.holders:
                sp.holders.add(node)
                sp.label.append(node)
            plan.delete.append(job)  # the node label is the record now
        elif i.now - i.finished_at(job) >= i.retry_seconds:
            plan.delete.append(job)  # tried again in the next round
        elif sp is not None:
            sp.fetches[node] = _status("failed", result=result or {"reason": "transfer",
                                                                   "message": "the fetch Job failed"})


def _choose_fetches(i: DeliveryInputs, eligible: dict[str, Any], plan: DeliveryPlan) -> None:
    """While fewer nodes hold (or fetch) every source than `replicas`, more nodes fetch what they
    lack: the pods' nodes first, then those holding or fetching the most, then by name; one fetch per
    node at a time, within the operator's fetch slots (the rest wait, `pending`)."""
    sources = plan.sources()
    states = {n: [sp.state(n) for sp in sources] for n in eligible}
    failed = {n for n, st in states.items() if "failed" in st}
    covered = {n for n, st in states.items() if n not in failed and None not in st}  # hold or fetch all
    missing = i.spec.replicas - len(covered)
    if missing <= 0:
        return
    by_progress = sorted(eligible, key=lambda n: (-sum(s is not None for s in states[n]), n))
    order = sorted(n for n in i.engine_nodes if n in eligible) + by_progress
    slots = i.max_fetches - i.active_elsewhere.get("", 0)
    busy = {n for n, count in i.active_elsewhere.items() if n and count} | {n for n, st in states.items()
                                                                            if "fetching" in st}
    for node in dict.fromkeys(order):
        if missing <= 0:
            break
        if node in covered or node in failed:
            continue
        missing -= 1
        for sp in sources:
            if sp.state(node) is not None:
                continue
            if slots > 0 and node not in busy:
                sp.start.append(node)
                sp.fetches[node] = _status("fetching")
                slots -= 1
                busy.add(node)
            else:
                sp.fetches[node] = _status("pending")


def _roll_or_hold(i: DeliveryInputs, ready: int, plan: DeliveryPlan) -> None:
    """The pods move to a new model or new adapters only once `replicas` nodes hold every source;
    until then they keep what they run."""
    spec, need = i.spec, i.spec.replicas
    if i.served is None or ready >= need:
        return
    moving = []
    if plan.model is not None and i.served.cache_key != plan.model.key:
        plan.pods_model = i.served
        moving.append(str(spec.model.uri))
    served_lora_key = i.served_lora.cache_key if i.served_lora is not None else None
    if plan.lora is not None and served_lora_key != plan.lora.key:
        plan.pods_lora = i.served_lora
        moving.append(f"{plan.lora.source.what}{plan.lora.source.uri}")
    if moving:
        plan.rolling_for_model = (f"fetching {' and '.join(moving)} onto {need} nodes before the pods move to it: "
                                  f"{ready}/{need} hold it")


def _verdict(need: int, plan: DeliveryPlan) -> Verdict:
    """ModelReady: Fetched once `need` nodes hold each source, FetchFailed when a source's failed
    fetches leave too few nodes holding or fetching it (naming each failed node and its reason),
    else Fetching (each fetch's progress or its wait for a slot)."""
    found = [_source_verdict(sp, need) for sp in plan.sources()]
    if all(v[0] == "True" for v in found):
        return ("True", "Fetched", "; ".join(v[2] for v in found))
    reason = "FetchFailed" if any(v[1] == "FetchFailed" for v in found) else "Fetching"
    return ("False", reason, "; ".join(v[2] for v in found if v[0] != "True")[:1000])


def _source_verdict(sp: SourcePlan, need: int) -> Verdict:
    held, what = len(sp.holders), f"{sp.source.what}{sp.source.uri}"
    if held >= need:
        return ("True", "Fetched", f"{held} of {need} nodes hold {what}")
    failed = [f"{n}: {st.get('reason')}: {st.get('message')}" for n, st in sorted(sp.fetches.items())
              if st["state"] == "failed"]
    running = [n for n, st in sp.fetches.items() if st["state"] in ("fetching", "pending")]
    if failed and held + len(running) < need:
        return ("False", "FetchFailed", f"{held}/{need} nodes hold {what}; " + "; ".join(failed)[:800])
    parts = []
    for n, st in sorted(sp.fetches.items()):
        if st["state"] == "fetching":
            pct = f" {st['percent']}% ({st['bytes']} of {st['totalBytes']} bytes)" if "percent" in st else ""
            parts.append(f"{n} fetching{pct}")
        elif st["state"] == "pending":
            parts.append(f"{n} waiting for a fetch slot")
    return ("False", "Fetching", f"{held}/{need} nodes hold {what}" + (f"; {', '.join(parts)}" if parts else ""))


def node_label_patch(key: str, present: bool) -> dict[str, Any]:
    return {"metadata": {"labels": {model_label(key): "true" if present else None}}}


def model_labels(node: dict[str, Any]) -> list[str]:
    """The cache keys a node is labelled as holding."""
    return [k[len(MODEL_LABEL_PREFIX):] for k, v in (node["metadata"].get("labels") or {}).items()
            if k.startswith(MODEL_LABEL_PREFIX) and v == "true"]
