"""kopf handlers for DLODeployment: thin, idempotent, one reconcile path for every trigger.

Owns: the kopf wiring (startup settings, create/resume/update handlers and a status timer) and
`reconcile`, which validates the spec (an invalid spec sets `Degraded` instead of crash-looping),
resolves the mode (`auto`: once, again only when the eligible nodes' profiles change), applies the
builders' objects with create-or-patch and owner references, deletes pods still on an old template
when the rollout is Recreate, and writes status (replica counts, nodes, conditions,
observedGeneration). Every decision is an Event on the resource.
Must never: build manifests itself (`builders`), decide a mode itself (`modes`), or import torch.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from dlo.operator import builders, modes, status
from dlo.operator.kube import Kube
from dlo.operator.models import GROUP, PLURAL, VERSION, DLODeploymentSpec, SpecError, parse_spec

log = logging.getLogger(__name__)
STATUS_INTERVAL_ENV = "DLO_OPERATOR_STATUS_INTERVAL"
STATUS_INTERVAL = float(os.environ.get(STATUS_INTERVAL_ENV, "15"))
RESOURCE = (GROUP, VERSION, PLURAL)
# Fields a spec change can make absent, which a merge-patch would otherwise leave behind.
PRUNE = {"StatefulSet": (("spec", "updateStrategy", "rollingUpdate"),)}


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # Keep kopf's bookkeeping in annotations: our status schema has no room for it.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    if getattr(memo, "kube", None) is None:
        memo.kube = Kube.from_environment()


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
def on_change(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    reconcile(memo.kube, body, patch)


@kopf.timer(*RESOURCE, interval=STATUS_INTERVAL, initial_delay=STATUS_INTERVAL / 2, idle=None)
def refresh(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    reconcile(memo.kube, body, patch)


def _condition_patch(conditions: list[dict[str, Any]], verdicts: dict[str, tuple[str, str, str]], gen: int | None) -> list[dict[str, Any]]:
    for type_, (st, reason, message) in verdicts.items():
        conditions = status.set_condition(conditions, type_, st, reason, message, gen)  # type: ignore[arg-type]
    return conditions


def reconcile(kube: Kube, body: kopf.Body, patch: kopf.Patch) -> None:
    """Bring the children of one DLODeployment to its spec and write its status."""
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
        patch.status["conditions"] = _condition_patch(
            conditions,
            {"Degraded": ("True", "InvalidSpec", str(e)), "Ready": ("False", "InvalidSpec", "spec is invalid")},
            generation,
        )
        patch.status["observedGeneration"] = generation
        return

    nodes = kube.list("v1", "Node")
    mode, reason, inputs = _mode(body, spec, nodes, current)

    objects = builders.build_all(owner, spec, mode, kube.has_resource("monitoring.coreos.com/v1", _monitor_plural(spec)))
    for obj in objects:
        kopf.append_owner_reference(obj, owner=body)
        outcome = kube.apply(obj, PRUNE.get(obj["kind"], ()))
        if outcome != "unchanged":
            kopf.info(body, reason=f"{obj['kind']}{outcome.capitalize()}", message=f"{obj['kind']} {obj['metadata']['name']} {outcome}")
    template = objects[[o["kind"] for o in objects].index("StatefulSet")]["spec"]["template"]
    template_hash = template["metadata"]["annotations"][builders.TEMPLATE_HASH]

    pods = kube.list("v1", "Pod", owner.namespace, builders.selector_labels(owner.name))
    if spec.rollout.type == "Recreate":
        pods = _recreate_old_pods(kube, body, pods, template_hash)

    cached = _cached_ratios(nodes, spec)
    summary = status.summarize(
        spec.replicas, template_hash, pods, cached, spec.warmer.threshold, spec.warmer.enabled, builders.TEMPLATE_HASH
    )
    verdicts = dict(summary.pop("verdicts"))
    verdicts["Degraded"] = ("False", "SpecValid", "")
    patch.status.update(summary)
    patch.status.update(
        {
            "observedGeneration": generation,
            "selector": builders.selector_string(owner.name),
            "mode": mode,
            "modeReason": reason,
            "modeInputs": inputs,
            "conditions": _condition_patch(conditions, verdicts, generation),
        }
    )


def _monitor_plural(spec: DLODeploymentSpec) -> str:
    return "podmonitors" if spec.monitoring.kind == "PodMonitor" else "servicemonitors"


def _mode(body: kopf.Body, spec: DLODeploymentSpec, nodes: list[dict[str, Any]], current: dict[str, Any]) -> tuple[str, str, str]:
    """The resolved mode; `auto` keeps its earlier decision while its inputs are unchanged."""
    if spec.mode == "auto" and current.get("mode") and current.get("modeInputs") == modes.inputs_digest(
        spec, modes.eligible_nodes(nodes, spec)
    ):
        return current["mode"], current.get("modeReason", ""), current["modeInputs"]
    resolution = modes.resolve_mode(spec, nodes)
    previous = current.get("mode")
    if previous != resolution.mode:
        if previous:
            kopf.info(body, reason="ModeChanged", message=f"{previous} -> {resolution.mode}: {resolution.reason}; pods roll")
        else:
            kopf.info(body, reason="ModeResolved", message=f"{resolution.mode}: {resolution.reason}")
    return resolution.mode, resolution.reason, resolution.inputs


def _recreate_old_pods(kube: Kube, body: kopf.Body, pods: list[dict[str, Any]], template_hash: str) -> list[dict[str, Any]]:
    """Recreate rollout (StatefulSet OnDelete): delete every pod on an old template, keep the rest."""
    kept = []
    for pod in pods:
        pod_meta = pod["metadata"]
        if pod_meta.get("deletionTimestamp") or pod_meta.get("annotations", {}).get(builders.TEMPLATE_HASH) == template_hash:
            kept.append(pod)
            continue
        if kube.delete("v1", "Pod", pod_meta["namespace"], pod_meta["name"]):
            kopf.info(body, reason="PodRecreated", message=f"deleted pod {pod_meta['name']} (old template)")
    return kept


def _cached_ratios(nodes: list[dict[str, Any]], spec: DLODeploymentSpec) -> dict[str, float | None]:
    """node name -> page-cache residency of this model, as the node's profile reports it."""
    from dlo.agent.profile import NodeProfile

    out: dict[str, float | None] = {}
    for node in nodes:
        raw = modes.node_profile_json(node)
        if raw is None:
            continue
        try:
            entry = NodeProfile.from_annotation(raw).models.get(spec.model.folder_name)
        except ValueError:
            log.warning("unreadable node profile node=%s", node["metadata"]["name"])
            continue
        out[node["metadata"]["name"]] = entry.resident_ratio if entry else None
    return out
