"""One reconcile of one DLODeployment, as named steps, over what the watch indexes hold.

Owns: `View` (the nodes, the resource's pods and fetch Jobs, copied from kopf's indexes) and `run`:
validate the spec (an invalid one sets `Degraded` instead of crash-looping), pin the deployment
plan (`pinned_plan`: made when the spec's generation, the pods' model or the replan annotation
changes; an inventory that would give another plan sets `PlanOutdated`), deliver the model and the
adapters (`uri`: fetch Jobs, node labels, which model and adapters the pods run), apply the builders' objects with server-side
apply and owner references, delete pods on an old template (all of them for a Recreate rollout; for
RollingUpdate those not ready, which the StatefulSet's rollout would wait on), report pods on lost
nodes (`node_loss`; force-deleted after the opt-in grace), and write
status (replica counts, nodes, URL, conditions, observedGeneration). Every decision is an Event on
the resource; every round is counted and timed in `metrics`.
Must never: build manifests itself (`builders`), decide a mode itself (`modes`) or where a model is
fetched (`delivery`), list what the indexes already hold, or import torch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import kopf
import urllib3
from opentelemetry import trace
from opentelemetry.trace import StatusCode

from dlo.operator import advice, builders, metrics, modes, node_loss, pinned_plan, status
from dlo.operator.autoscale_builder import autoscaler_kind
from dlo.operator.delivery_run import deliver
from dlo.operator.pod_reasons import Problem, pod_problems
from dlo.operator.config import OperatorConfig
from dlo.operator.kube import Kube, KubeError
from dlo.operator.models import API_VERSION, KIND, DLODeploymentSpec, SpecError, parse_spec, with_default_image

log = logging.getLogger(__name__)
TRACER = trace.get_tracer("dlo.operator")  # the global provider's once `dlo.cli.tracing` sets one
MONITOR_PLURALS = {"PodMonitor": "podmonitors", "ServiceMonitor": "servicemonitors"}

Verdict = tuple[str, str, str]  # (status, reason, message) of one condition


@dataclass
class View:
    """What the indexes hold that one reconcile reads: references to plain dicts that their watch
    handlers replace on a change and never change in place; read-only here."""

    nodes: list[dict[str, Any]] = field(default_factory=list)
    pods: list[dict[str, Any]] = field(default_factory=list)  # this resource's dlo pods (engine, fetch)
    all_pods: list[dict[str, Any]] = field(default_factory=list)  # every dlo pod (what each node serves)
    jobs: list[dict[str, Any]] = field(default_factory=list)  # this resource's fetch Jobs
    all_jobs: list[dict[str, Any]] = field(default_factory=list)  # every fetch Job (the fetch slots)
    statefulset: dict[str, Any] | None = None  # this resource's, as the watch last saw it (None: none seen)

    def engine_pods(self) -> list[dict[str, Any]]:
        return [p for p in self.pods if (p["metadata"].get("labels") or {}).get(builders.COMPONENT) == "engine"]


def run(kube: Kube, body: dict[str, Any], view: View, config: OperatorConfig) -> bool:
    """One reconcile, counted, timed, traced (`dlo.reconcile`, a no-op unless the operator traces)
    and its status written; False when it must be retried soon."""
    meta = body["metadata"]
    with TRACER.start_as_current_span("dlo.reconcile", attributes={
            "k8s.namespace.name": meta.get("namespace") or "", "dlo.deployment": meta["name"],
            "dlo.generation": meta.get("generation") or 0}) as span:
        started = time.monotonic()
        result = "error"
        patch: dict[str, Any] = {}
        try:
            result = reconcile(kube, body, view, config, patch)
        except (KubeError, urllib3.exceptions.HTTPError) as e:
            result = "api_error"
            conditions = list((body.get("status") or {}).get("conditions") or [])
            verdict = {"Degraded": ("True", "ApiError", f"{type(e).__name__}: {e}"[:1000])}
            patch = {"conditions": _conditions(conditions, verdict, meta.get("generation"))}
            log.warning("reconcile failed on an API error resource=%s/%s error=%s", meta.get("namespace"),
                        meta["name"], e)
        except Exception as e:  # a bug must not stop the loop: logged, counted, retried
            log.exception("reconcile failed resource=%s/%s", meta.get("namespace"), meta["name"])
            span.record_exception(e)
        finally:
            metrics.RECONCILES.labels(result).inc()
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
            span.set_attribute("dlo.reconcile.result", result)
        if patch:
            _write_status(kube, body, patch)
        if result in ("error", "api_error"):
            span.set_status(StatusCode.ERROR, result)
        return result in ("success", "invalid_spec")


def _write_status(kube: Kube, body: dict[str, Any], patch: dict[str, Any]) -> None:
    meta = body["metadata"]
    current = body.get("status") or {}
    if all(current.get(k) == v for k, v in patch.items()):
        return  # nothing new: no write, no event
    try:
        kube.patch(API_VERSION, KIND, meta["namespace"], meta["name"], {"status": patch}, subresource="status")
    except (KubeError, urllib3.exceptions.HTTPError) as e:
        log.warning("status write failed resource=%s/%s error=%s", meta["namespace"], meta["name"], e)
        return
    if patch.get("conditions") is not None:
        metrics.CONDITIONS.observe(meta["namespace"], meta["name"], list(patch["conditions"]))


def reconcile(kube: Kube, body: dict[str, Any], view: View, config: OperatorConfig, patch: dict[str, Any]) -> str:
    """Bring the children of one DLODeployment to its spec; the status goes into `patch`.
    Returns the result for `dlo_operator_reconciles_total`: `success` or `invalid_spec`."""
    meta = body["metadata"]
    owner = builders.Owner(meta["name"], meta["namespace"])
    generation = meta.get("generation")
    current = body.get("status") or {}
    conditions = list(current.get("conditions") or [])
    spec = _valid_spec(body, conditions, generation, patch, config)
    if spec is None:
        return "invalid_spec"
    plan = deliver(kube, body, owner, spec, view, config)
    pods_spec = spec if plan is None else spec.model_copy(update={"model": plan.pods_model, "lora": plan.pods_lora})
    pinned, outdated = _pin(body, spec, pods_spec, view.nodes, conditions)
    ctx = _context(kube, spec, config, pinned.memory_bytes)
    monitor_crd = kube.has_resource("monitoring.coreos.com/v1", MONITOR_PLURALS[spec.monitoring.kind])
    objects = builders.build_all(owner, spec, pinned.mode, monitor_crd, ctx, pods_spec)
    _apply(kube, body, objects, view.statefulset)
    _retire_network_policy(kube, owner, objects, view.statefulset)
    autoscaler = _retire_autoscaler(kube, owner, current, objects)
    (sts,) = [o for o in objects if o["kind"] == "StatefulSet"]
    template_hash = sts["spec"]["template"]["metadata"]["annotations"][builders.TEMPLATE_HASH]
    pods = view.engine_pods()
    pods = _delete_old_pods(kube, body, pods, template_hash, unready_only=spec.rollout.type == "RollingUpdate")
    grace = spec.rollout.node_loss_grace_seconds
    lost = _node_loss(kube, body, pods, view.nodes, grace)
    observed = status.Observed(
        spec.replicas, template_hash, pods, modes.model_residency(view.nodes, pods_spec), spec.warmer.threshold,
        spec.warmer.enabled, builders.TEMPLATE_HASH,
        problems=[Problem("NodeLost", p.pod, p.message(grace)) for p in lost]
        + pod_problems([p for p in pods if not status.pod_ready(p)], _events_of(kube)),
        model=plan.verdict if plan else None, fetches=plan.model.fetches if plan and plan.model else {},
        lora_fetches=plan.lora.fetches if plan and plan.lora else {},
        rolling_for_model=plan.rolling_for_model if plan else "")
    summary = status.summarize(observed)
    verdicts = {**summary.pop("verdicts"), "Degraded": _health(body, conditions, pods, lost, grace),
                "PlanOutdated": outdated}
    patch.update(summary)
    patch.update({
        "observedGeneration": generation,
        "selector": builders.selector_string(owner.name),
        "url": builders.service_url(owner, spec),
        "mode": pinned.mode,
        "modeReason": pinned.reason,
        "modeInputs": pinned.inputs,
        "plan": pinned.to_status(),
        "warnings": advice.warnings(spec, ctx.autoscaler),
        "autoscaler": autoscaler,
        "conditions": _conditions(conditions, verdicts, generation),
    })
    return "success"


def _context(kube: Kube, spec: DLODeploymentSpec, config: OperatorConfig, memory_bytes: int | None) -> builders.BuildContext:
    """What the builders need beyond the spec: the pinned plan's memory request, the autoscaler kind,
    the config."""
    keda = spec.autoscaling.enabled and kube.has_resource("keda.sh/v1alpha1", "scaledobjects")
    return builders.BuildContext(
        cache_root=config.cache_root, memory_bytes=memory_bytes, autoscaler=autoscaler_kind(spec, keda),
        prometheus_url=config.prometheus_url, monitoring_release=config.monitoring_release,
        network_policy=config.network_policy, fetch=config.fetch, log_format=config.log_format)


def _retire_network_policy(kube: Kube, owner: builders.Owner, objects: list[dict[str, Any]],
                           live_sts: dict[str, Any] | None) -> None:
    """The NetworkPolicy the operator kept (its StatefulSet says so) is deleted once it makes none
    (`--network-policy` turned off): a policy nobody keeps would go on filtering the engines."""
    kept = (((live_sts or {}).get("metadata") or {}).get("annotations") or {}).get(builders.NETWORK_POLICY_ANNOTATION)
    if kept and not any(o["kind"] == "NetworkPolicy" for o in objects):
        kube.delete("networking.k8s.io/v1", "NetworkPolicy", owner.namespace, owner.name)


AUTOSCALER_KINDS = {"ScaledObject": "keda.sh/v1alpha1", "HorizontalPodAutoscaler": "autoscaling/v2"}


def _retire_autoscaler(kube: Kube, owner: builders.Owner, current: dict[str, Any], objects: list[dict[str, Any]]) -> str:
    """The autoscaler kind applied now; the one the status recorded before is deleted when it is
    another (autoscaling turned off, or KEDA installed or removed)."""
    now = next((o["kind"] for o in objects if o["kind"] in AUTOSCALER_KINDS), "")
    before = current.get("autoscaler") or ""
    if before and before != now:
        kube.delete(AUTOSCALER_KINDS[before], before, owner.namespace, owner.name)
    return now


def _events_of(kube: Kube) -> Any:
    """The Events of a pod (asked only for a pod that is scheduled and has not started)."""
    def events(pod: dict[str, Any]) -> list[dict[str, Any]]:
        meta = pod["metadata"]
        return kube.list("v1", "Event", meta["namespace"], fields={"involvedObject.name": meta["name"],
                                                                  "involvedObject.kind": "Pod"})
    return events


def _valid_spec(body: dict[str, Any], conditions: list[dict[str, Any]], generation: int | None,
                patch: dict[str, Any], config: OperatorConfig) -> DLODeploymentSpec | None:
    """The parsed spec with the default image, or None after writing why it is invalid."""
    try:
        spec = parse_spec(dict(body.get("spec") or {}))
    except SpecError as e:
        if (status.condition(conditions, "Degraded") or {}).get("message") != str(e):
            kopf.warn(body, reason="InvalidSpec", message=str(e))
        verdicts = {"Degraded": ("True", "InvalidSpec", str(e)), "Ready": ("False", "InvalidSpec", "spec is invalid")}
        patch["conditions"] = _conditions(conditions, verdicts, generation)
        patch["observedGeneration"] = generation
        return None
    return with_default_image(spec, config.default_image)


def _apply(kube: Kube, body: dict[str, Any], objects: list[dict[str, Any]], live_sts: dict[str, Any] | None) -> None:
    """Apply each object; one applied before unchanged is not sent again while it is as that apply
    left it: the StatefulSet by the watch's generation (-1: none seen, so apply), the others for a
    while (`kube.REAPPLY_S`)."""
    sts_generation = ((live_sts or {}).get("metadata") or {}).get("generation", -1)
    for obj in objects:
        kopf.append_owner_reference(obj, owner=body)
        outcome = kube.apply(obj, live_generation=sts_generation if obj["kind"] == "StatefulSet" else None)
        if outcome != "unchanged":
            kind, name = obj["kind"], obj["metadata"]["name"]
            kopf.info(body, reason=f"{kind}{outcome.capitalize()}", message=f"{kind} {name} {outcome}")


def _health(body: dict[str, Any], conditions: list[dict[str, Any]], pods: list[dict[str, Any]],
            lost: list[node_loss.LostPod], grace: int | None) -> Verdict:
    """Degraded for a valid spec: True while an engine pod's node is lost (NodeLost, naming the
    node) or an engine pod crash-loops (a Warning Event per new finding), False again once every
    pod's node is back and every container runs."""
    found = [f"pod {p.pod}: {p.message(grace)}" for p in lost] + status.crash_looping(pods)
    if not found:
        return ("False", "SpecValid", "")
    reason = "NodeLost" if lost else "EngineCrashLooping"
    message = "; ".join(found)[:1000]
    if (status.condition(conditions, "Degraded") or {}).get("reason") != reason:
        kopf.warn(body, reason=reason, message=message)  # once per episode, not per restart
    return ("True", reason, message)


def _node_loss(kube: Kube, body: dict[str, Any], pods: list[dict[str, Any]], nodes: list[dict[str, Any]],
               grace: int | None) -> list[node_loss.LostPod]:
    """The engine pods on lost nodes; with `spec.rollout.nodeLossGraceSeconds`, those lost for longer
    are force-deleted (uid precondition), so the StatefulSet recreates them on a node that runs."""
    by_name = {n["metadata"]["name"]: n for n in nodes}
    lost = node_loss.lost_pods(pods, by_name, time.time(), grace)
    for p in lost:
        if p.force_due and kube.delete("v1", "Pod", body["metadata"]["namespace"], p.pod, uid=p.uid, grace_seconds=0):
            kopf.warn(body, reason="PodForceDeleted", message=f"force-deleted pod {p.pod}: node {p.node} is {p.why} "
                      f"for more than {grace}s (spec.rollout.nodeLossGraceSeconds)")
    return lost


def _conditions(conditions: list[dict[str, Any]], verdicts: dict[str, Verdict], generation: int | None) -> list[dict[str, Any]]:
    for type_, (st, reason, message) in verdicts.items():
        conditions = status.set_condition(conditions, type_, st, reason, message, generation)  # type: ignore[arg-type]
    return conditions


def _pin(body: dict[str, Any], spec: DLODeploymentSpec, pods_spec: DLODeploymentSpec, nodes: list[dict[str, Any]],
         conditions: list[dict[str, Any]]) -> tuple[pinned_plan.PinnedPlan, Verdict]:
    """The plan the pods run (`pinned_plan.pin`) and the PlanOutdated verdict; an Event when a plan
    is made, when it changes the mode, and when the inventory first outdates it."""
    pinned, replaced, outdated = pinned_plan.pin(body, spec, pods_spec, nodes)
    if replaced is None and pinned.to_status() != (body.get("status") or {}).get("plan"):
        if (body.get("status") or {}).get("plan") is None:
            kopf.info(body, reason="ModeResolved", message=f"{pinned.mode}: {pinned.reason}")
    elif replaced is not None:
        change = replaced.differs(pinned)
        kopf.info(body, reason="PlanMade", message=change or f"{pinned.mode}: unchanged")
        if replaced.mode != pinned.mode:
            kopf.info(body, reason="ModeChanged", message=f"{replaced.mode} -> {pinned.mode}: {pinned.reason}; the pods roll")
    previous = status.condition(conditions, "PlanOutdated") or {}
    if outdated[0] == "True" and previous.get("message") != outdated[2]:
        kopf.warn(body, reason="PlanOutdated", message=outdated[2])
    return pinned, outdated


def _delete_old_pods(kube: Kube, body: dict[str, Any], pods: list[dict[str, Any]], template_hash: str,
                     unready_only: bool) -> list[dict[str, Any]]:
    """Delete pods on an old template; return the rest. Recreate (StatefulSet OnDelete): every one.
    RollingUpdate: only those not ready (they serve nothing): the StatefulSet's rollout counts them
    as unavailable and would wait on them for ever (a pod of a broken template, fixed since).
    Each delete names the uid read (a precondition): a pod the StatefulSet re-created under the same
    name since the list is never deleted for its predecessor's template."""
    kept = []
    for pod in pods:
        meta = pod["metadata"]
        if (meta.get("deletionTimestamp") or meta.get("annotations", {}).get(builders.TEMPLATE_HASH) == template_hash
                or (unready_only and status.pod_ready(pod))):
            kept.append(pod)
        elif kube.delete("v1", "Pod", meta["namespace"], meta["name"], uid=meta.get("uid")):
            if unready_only:
                kopf.info(body, reason="PodReplaced", message=f"deleted pod {meta['name']} (old template, not ready: "
                          "the rollout would wait on it)")
            else:
                kopf.info(body, reason="PodRecreated", message=f"deleted pod {meta['name']} (old template)")
    return kept
