"""Model delivery for `spec.model.uri`: which nodes hold the model, which must fetch it, which model
the pods run while a new one is fetched, and what the status says. Pure: the reconcile carries the
plan out (creates and deletes fetch Jobs, labels nodes).

Owns: `plan_delivery` -> `DeliveryPlan`. A node holds a model completely when it carries the label
`model.dlo.dev/<cache key>` (set when a fetch Job for it succeeded there, or when the node's
profile lists the folder; removed when a fetch reports it evicted). When fewer eligible nodes
hold it than `replicas`, more fetch it: the nodes the pods run on first, then the others by name;
one fetch per node, at most `max_fetches` over every DLODeployment, a failed one kept for
`fetch_retry_seconds` (its reason in the status) and then tried again. A new uri or revision is
fetched before the pods move to it: the StatefulSet keeps the model its pods run
(`dlo.dev/model-source`) until enough nodes hold the new one.
Must never: call the API server, read a Secret, or evict (only `dlo fetch` does, never a model in use).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dlo.plan.profile import NodeProfile
from dlo.operator import modes
from dlo.operator.model_spec import ModelSource
from dlo.operator.models import DLODeploymentSpec
from dlo.operator.names import (COMPONENT, FETCH_NODE_ANNOTATION, MODEL_KEY_ANNOTATION, MODEL_LABEL_PREFIX,
                                model_label)

Progress = tuple[int, int, int, int]  # bytes, total, files done, files (the fetch's last progress line)
Verdict = tuple[str, str, str]


@dataclass
class DeliveryPlan:
    pods_model: ModelSource  # what the StatefulSet's pods run
    verdict: Verdict  # ModelReady
    fetches: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> NodeModelStatus fields
    start: list[str] = field(default_factory=list)  # nodes to start a fetch Job on
    delete: list[dict[str, Any]] = field(default_factory=list)  # Jobs done with (recorded, retried, stale)
    label: list[str] = field(default_factory=list)  # nodes that now hold the wanted model
    unlabel: list[tuple[str, str]] = field(default_factory=list)  # (node, key) evicted there
    keep: dict[str, list[str]] = field(default_factory=dict)  # node -> keys its pods use (never evicted)
    rolling_for_model: str = ""
    completed: list[tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=list)  # (Job, its result)


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
    """node -> the cache keys its engine pods (of any DLODeployment) run."""
    out: dict[str, set[str]] = {}
    for pod in all_pods:
        meta = pod["metadata"]
        node = (pod.get("spec") or {}).get("nodeName")
        key = (meta.get("annotations") or {}).get(MODEL_KEY_ANNOTATION)
        if node and key and (meta.get("labels") or {}).get(COMPONENT) == "engine" and not meta.get("deletionTimestamp"):
            out.setdefault(node, set()).add(key)
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
    served: ModelSource | None
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


def plan_delivery(i: DeliveryInputs) -> DeliveryPlan:
    """What to do for one DLODeployment with a `model.uri` (see the module docstring)."""
    spec, key = i.spec, i.spec.model.cache_key or ""
    plan = DeliveryPlan(pods_model=spec.model, verdict=("Unknown", "Fetching", ""), keep=i.in_use)
    eligible = {n["metadata"]["name"]: n for n in modes.eligible_nodes(i.nodes, spec)}
    holders = {name for name, n in eligible.items() if holds(n, key)}
    for name, node in eligible.items():
        if name not in holders and _profile_lists(node, key):  # fetched before, or copied there
            holders.add(name)
            plan.label.append(name)
    failed = _read_jobs(i, key, eligible, holders, plan)
    for name in holders:
        plan.fetches[name] = _status("complete")
    need = spec.replicas
    active = [n for n, st in plan.fetches.items() if st["state"] == "fetching"]
    _choose_fetches(i, eligible, holders, set(active) | failed, need, plan)
    _roll_or_hold(i, key, len(holders), need, plan)
    plan.verdict = _verdict(spec, len(holders), need, plan)
    return plan


def _read_jobs(i: DeliveryInputs, key: str, eligible: dict[str, Any], holders: set[str], plan: DeliveryPlan) -> set[str]:
    """Fold each fetch Job into the plan; the nodes whose last fetch failed (and waits for a retry)."""
    failed: set[str] = set()
    wanted_keys = {key} | ({i.served.cache_key} if i.served is not None and i.served.cache_key else set())
    for job in i.jobs:
        annotations = job["metadata"].get("annotations") or {}
        node, job_key = annotations.get(FETCH_NODE_ANNOTATION, ""), annotations.get(MODEL_KEY_ANNOTATION, "")
        state = job_state(job)
        if job_key not in wanted_keys or (node not in eligible and state == "active"):
            plan.delete.append(job)  # a model no longer wanted, or a node no longer usable
            continue
        if state == "active":
            if job_key == key:
                plan.fetches[node] = _status("fetching", i.progress_of(job))
            continue
        result = job_result(job, i.fetch_pods)
        for evicted in result.get("evicted") or []:
            plan.unlabel.append((node, str(evicted)))
        if state == "succeeded" and result.get("state") == "complete":
            plan.completed.append((job, result))
            if job_key == key and node in eligible and node not in holders:
                holders.add(node)
                plan.label.append(node)
            plan.delete.append(job)  # the node label is the record now
        elif i.now - i.finished_at(job) >= i.retry_seconds:
            plan.delete.append(job)  # tried again in the next round
        elif job_key == key:
            failed.add(node)
            plan.fetches[node] = _status("failed", result=result or {"reason": "transfer",
                                                                     "message": "the fetch Job failed"})
    return failed


def _choose_fetches(i: DeliveryInputs, eligible: dict[str, Any], holders: set[str], busy: set[str], need: int,
                    plan: DeliveryPlan) -> None:
    """More nodes fetch while fewer hold the model than `need`: the pods' nodes first, one fetch per
    node, within the operator's fetch slots (the rest wait, `pending`)."""
    missing = need - len(holders) - len([n for n in busy if plan.fetches.get(n, {}).get("state") == "fetching"])
    if missing <= 0:
        return
    order = sorted(n for n in i.engine_nodes if n in eligible) + sorted(eligible)
    slots = i.max_fetches - i.active_elsewhere.get("", 0)
    for node in dict.fromkeys(order):
        if missing <= 0:
            break
        if node in holders or node in busy:
            continue
        missing -= 1
        if slots > 0 and not i.active_elsewhere.get(node):
            plan.start.append(node)
            plan.fetches[node] = _status("fetching")
            slots -= 1
        else:
            plan.fetches[node] = _status("pending")


def _roll_or_hold(i: DeliveryInputs, key: str, held: int, need: int, plan: DeliveryPlan) -> None:
    """The pods move to a new model only once `need` nodes hold it; until then they keep theirs."""
    served = i.served
    if served is None or served.cache_key == key or held >= need:
        return
    plan.pods_model = served
    plan.rolling_for_model = (f"fetching {i.spec.model.uri} onto {need} nodes before the pods move to it: "
                              f"{held}/{need} hold it")


def _verdict(spec: DLODeploymentSpec, held: int, need: int, plan: DeliveryPlan) -> Verdict:
    uri = spec.model.uri
    if held >= need:
        return ("True", "Fetched", f"{held} of {need} nodes hold {uri}")
    failed = [f"{n}: {st.get('reason')}: {st.get('message')}" for n, st in sorted(plan.fetches.items())
              if st["state"] == "failed"]
    running = [n for n, st in plan.fetches.items() if st["state"] in ("fetching", "pending")]
    if failed and held + len(running) < need:
        return ("False", "FetchFailed", f"{held}/{need} nodes hold {uri}; " + "; ".join(failed)[:800])
    parts = []
    for n, st in sorted(plan.fetches.items()):
        if st["state"] == "fetching":
            pct = f" {st['percent']}% ({st['bytes']} of {st['totalBytes']} bytes)" if "percent" in st else ""
            parts.append(f"{n} fetching{pct}")
        elif st["state"] == "pending":
            parts.append(f"{n} waiting for a fetch slot")
    return ("False", "Fetching", f"{held}/{need} nodes hold {uri}" + (f"; {', '.join(parts)}" if parts else ""))


def node_label_patch(key: str, present: bool) -> dict[str, Any]:
    return {"metadata": {"labels": {model_label(key): "true" if present else None}}}


def model_labels(node: dict[str, Any]) -> list[str]:
    """The cache keys a node is labelled as holding."""
    return [k[len(MODEL_LABEL_PREFIX):] for k, v in (node["metadata"].get("labels") or {}).items()
            if k.startswith(MODEL_LABEL_PREFIX) and v == "true"]
