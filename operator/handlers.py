"""kopf handlers for DLODeployment: thin, idempotent, one reconcile path for every trigger.

Owns: the kopf wiring (startup settings, create/resume/update handlers and a status timer) and
`reconcile`, which validates the spec (an invalid spec sets `Degraded` instead of crash-looping),
resolves the mode (`auto`: once, again only when the eligible nodes' profiles change), applies the
builders' objects with create-or-patch and owner references, deletes pods still on an old template
when the rollout is Recreate, and writes status (replica counts, nodes, URL, conditions,
observedGeneration; `Degraded` also while an engine pod crash-loops). Every decision is an Event
on the resource; every reconcile is counted and timed in `metrics`.
Must never: build manifests itself (`builders`), decide a mode itself (`modes`), or import torch.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import kopf
import urllib3

from dlo.operator import builders, metrics, modes, status
from dlo.operator.kube import Kube, KubeError
from dlo.operator.models import GROUP, PLURAL, VERSION, DLODeploymentSpec, SpecError, parse_spec
from dlo.operator.models import default_engine_image, with_default_image

STATUS_INTERVAL_ENV = "DLO_OPERATOR_STATUS_INTERVAL"
STATUS_INTERVAL = float(os.environ.get(STATUS_INTERVAL_ENV, "15"))
# A failed reconcile (an API error, a timeout) is retried after one status interval, not after
# kopf's default minute: a transient 500 must not hold a rollout or a status refresh that long.
RETRY_BACKOFF = STATUS_INTERVAL
RESOURCE = (GROUP, VERSION, PLURAL)
# Fields a spec change can make absent, which a merge-patch would otherwise leave behind.
PRUNE = {"StatefulSet": (("spec", "updateStrategy", "rollingUpdate"),)}
MONITOR_PLURALS = {"PodMonitor": "podmonitors", "ServiceMonitor": "servicemonitors"}

Verdict = tuple[str, str, str]  # (status, reason, message) of one condition


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Keep kopf's bookkeeping in annotations: our status schema has no room for it.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    if getattr(memo, "kube", None) is None:
        memo.kube = Kube.from_environment()
    if getattr(memo, "default_image", None) is None:
        memo.default_image = default_engine_image(os.environ)


@kopf.on.resume(*RESOURCE, backoff=RETRY_BACKOFF)
@kopf.on.create(*RESOURCE, backoff=RETRY_BACKOFF)
@kopf.on.update(*RESOURCE, field="spec", backoff=RETRY_BACKOFF)
def on_change(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    _reconcile_or_report(memo.kube, body, patch, getattr(memo, "default_image", None))


@kopf.timer(*RESOURCE, interval=STATUS_INTERVAL, initial_delay=STATUS_INTERVAL / 2, backoff=RETRY_BACKOFF)
def refresh(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    _reconcile_or_report(memo.kube, body, patch, getattr(memo, "default_image", None))


@kopf.on.event(*RESOURCE)
def observe(event: kopf.RawEvent, **_: Any) -> None:
    """Keep `dlo_operator_dlodeployments` to the resources that exist (no finalizer needed)."""
    if event.get("type") == "DELETED":
        meta = event["object"]["metadata"]
        metrics.CONDITIONS.forget(meta.get("namespace", ""), meta["name"])


def _reconcile_or_report(kube: Kube, body: kopf.Body, patch: kopf.Patch, default_image: str | None = None) -> None:
    """`reconcile`; an API failure sets `Degraded=True` (reason ApiError) with what failed, so
    `kubectl describe` shows why nothing moves, and the handler is retried after the backoff.
    Each reconcile is counted and timed (`metrics`), and the conditions written are recorded."""
    started = time.monotonic()
    result = "error"
    try:
        result = reconcile(kube, body, patch, default_image)
    except (KubeError, urllib3.exceptions.HTTPError) as e:
        result = "api_error"
        conditions = list((body.get("status") or {}).get("conditions") or [])
        verdict = {"Degraded": ("True", "ApiError", f"{type(e).__name__}: {e}"[:1000])}
        patch.status["conditions"] = _conditions(conditions, verdict, body["metadata"].get("generation"))
        raise kopf.TemporaryError(str(e), delay=RETRY_BACKOFF) from e
    finally:
        metrics.RECONCILES.labels(result).inc()
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
        written = (patch.get("status") or {}).get("conditions")
        if written is not None:
            meta = body["metadata"]
            metrics.CONDITIONS.observe(meta["namespace"], meta["name"], list(written))


def reconcile(kube: Kube, body: kopf.Body, patch: kopf.Patch, default_image: str | None = None) -> str:
    """Bring the children of one DLODeployment to its spec and write its status into `patch`.

    `default_image`: the engine image for a spec that names none (default: the built-in one).
    Returns the result for `dlo_operator_reconciles_total`: `success` or `invalid_spec`.
    """
    meta = body["metadata"]
    owner = builders.Owner(meta["name"], meta["namespace"])
    generation = meta.get("generation")
    current = dict(body.get("status") or {})
    conditions = list(current.get("conditions") or [])
    try:
        spec = parse_spec(dict(body.get("spec") or {}))
    except SpecError as e:
        if (status.condition(conditions, "Degraded") or {}).get("message") != str(e):
            kopf.warn(body, reason="InvalidSpec", message=str(e))
        verdicts = {"Degraded": ("True", "InvalidSpec", str(e)), "Ready": ("False", "InvalidSpec", "spec is invalid")}
        patch.status["conditions"] = _conditions(conditions, verdicts, generation)
        patch.status["observedGeneration"] = generation
        return "invalid_spec"
    if default_image:
        spec = with_default_image(spec, default_image)

    nodes = kube.list("v1", "Node")
    resolution = _resolve(body, spec, nodes, current)

    monitor_crd = kube.has_resource("monitoring.coreos.com/v1", MONITOR_PLURALS[spec.monitoring.kind])
    objects = builders.build_all(owner, spec, resolution.mode, monitor_crd)
    for obj in objects:
        kopf.append_owner_reference(obj, owner=body)
        outcome = kube.apply(obj, PRUNE.get(obj["kind"], ()))
        if outcome != "unchanged":
            kind, name = obj["kind"], obj["metadata"]["name"]
            kopf.info(body, reason=f"{kind}{outcome.capitalize()}", message=f"{kind} {name} {outcome}")
    (sts,) = [o for o in objects if o["kind"] == "StatefulSet"]
    template_hash = sts["spec"]["template"]["metadata"]["annotations"][builders.TEMPLATE_HASH]

    pods = kube.list("v1", "Pod", owner.namespace, builders.selector_labels(owner.name))
    if spec.rollout.type == "Recreate":
        pods = _delete_old_pods(kube, body, pods, template_hash)

    summary = status.summarize(
        spec.replicas,
        template_hash,
        pods,
        modes.model_residency(nodes, spec),
        spec.warmer.threshold,
        spec.warmer.enabled,
        builders.TEMPLATE_HASH,
    )
    verdicts = {**summary.pop("verdicts"), "Degraded": _health(body, conditions, pods)}
    patch.status.update(summary)
    patch.status.update(
        {
            "observedGeneration": generation,
            "selector": builders.selector_string(owner.name),
            "url": builders.service_url(owner, spec),
            "mode": resolution.mode,
            "modeReason": resolution.reason,
            "modeInputs": resolution.inputs,
            "conditions": _conditions(conditions, verdicts, generation),
        }
    )
    return "success"


def _health(body: kopf.Body, conditions: list[dict[str, Any]], pods: list[dict[str, Any]]) -> Verdict:
    """Degraded for a valid spec: True while an engine pod crash-loops (a Warning Event per new
    finding), False again once every container runs."""
    crashing = status.crash_looping(pods)
    if not crashing:
        return ("False", "SpecValid", "")
    message = "; ".join(crashing)[:1000]
    if (status.condition(conditions, "Degraded") or {}).get("reason") != "EngineCrashLooping":
        kopf.warn(body, reason="EngineCrashLooping", message=message)  # once per episode, not per restart
    return ("True", "EngineCrashLooping", message)


def _conditions(conditions: list[dict[str, Any]], verdicts: dict[str, Verdict], generation: int | None) -> list[dict[str, Any]]:
    for type_, (st, reason, message) in verdicts.items():
        conditions = status.set_condition(conditions, type_, st, reason, message, generation)  # type: ignore[arg-type]
    return conditions


def _resolve(body: kopf.Body, spec: DLODeploymentSpec, nodes: list[dict[str, Any]], current: dict[str, Any]) -> modes.Resolution:
    """The mode, keeping an earlier `auto` decision while its inputs stand; an Event on a change."""
    previous = None
    if current.get("mode"):
        previous = modes.Resolution(current["mode"], current.get("modeReason", ""), current.get("modeInputs", ""))
    resolution = modes.resolve_mode(spec, nodes, previous)
    if previous is None:
        kopf.info(body, reason="ModeResolved", message=f"{resolution.mode}: {resolution.reason}")
    elif previous.mode != resolution.mode:
        message = f"{previous.mode} -> {resolution.mode}: {resolution.reason}; the pods roll"
        kopf.info(body, reason="ModeChanged", message=message)
    return resolution


def _delete_old_pods(kube: Kube, body: kopf.Body, pods: list[dict[str, Any]], template_hash: str) -> list[dict[str, Any]]:
    """Recreate rollout (StatefulSet OnDelete): delete every pod on an old template; return the rest."""
    kept = []
    for pod in pods:
        meta = pod["metadata"]
        if meta.get("deletionTimestamp") or meta.get("annotations", {}).get(builders.TEMPLATE_HASH) == template_hash:
            kept.append(pod)
        elif kube.delete("v1", "Pod", meta["namespace"], meta["name"]):
            kopf.info(body, reason="PodRecreated", message=f"deleted pod {meta['name']} (old template)")
    return kept
