"""Pure builders: a DLODeployment spec (and its resolved mode) -> the Kubernetes objects it owns.

Owns: the StatefulSet (its pod template is `pod_builder`'s), the headless and client Services, the
PodDisruptionBudget, the optional PodMonitor/ServiceMonitor, NetworkPolicy (`netpol_builder`) and
autoscaling object, and `build_all`. Names and labels are `names`'s; fetch Jobs are `fetch_builder`'s.
Must never: call the API server, read the clock or the environment: same input, same output.
Owner references are added by the reconcile (they need the live object's uid).
"""

from __future__ import annotations

import re
from typing import Any

from dlo.plan.facts import Mode
from dlo.operator.autoscale_builder import build_autoscaler
from dlo.operator.netpol_builder import build_network_policy
from dlo.operator.models import DLODeploymentSpec
from dlo.operator.names import (COMPONENT, HTTP_PORT_NAME, INSTANCE, LORA_SOURCE_ANNOTATION, MANAGED_BY,
                                MODE_ANNOTATION, MODEL_KEY_ANNOTATION, MODEL_MOUNT, MODEL_SOURCE_ANNOTATION, NETWORK_POLICY_ANNOTATION,
                                PART_OF, TEMPLATE_HASH, VIDEO_MOUNT, BuildContext, Owner, headless_service_name, labels,
                                meta, selector_labels, selector_string)
from dlo.operator.names import service_url as _service_url
from dlo.operator.pod_builder import (engine_command, engine_image, pod_template, readiness_path, template_hash,
                                      termination_grace_seconds)

__all__ = [
    "COMPONENT", "HTTP_PORT_NAME", "INSTANCE", "MANAGED_BY", "MODE_ANNOTATION", "MODEL_KEY_ANNOTATION", "MODEL_MOUNT",
    "MODEL_SOURCE_ANNOTATION", "NETWORK_POLICY_ANNOTATION", "PART_OF", "TEMPLATE_HASH", "VIDEO_MOUNT", "BuildContext",
    "ENGINE_RELABELINGS",
    "Owner", "build_all", "build_client_service", "build_headless_service", "build_monitor", "build_pdb",
    "build_statefulset", "engine_command", "engine_image", "headless_service_name", "labels", "pod_template",
    "readiness_path", "selector_labels", "selector_string", "service_url", "template_hash",
    "termination_grace_seconds", "update_strategy",
]
STATEFULSET_STRATEGIES = ("OnDelete", "RollingUpdate")  # the only values apps/v1 accepts


def service_url(owner: Owner, spec: DLODeploymentSpec) -> str:
    """The client Service's URL inside the cluster (`status.url`)."""
    return _service_url(owner, spec.service.port)


def update_strategy(spec: DLODeploymentSpec) -> dict[str, Any]:
    """Recreate -> OnDelete (the operator deletes old pods); RollingUpdate never surges."""
    if spec.rollout.type == "Recreate":
        return {"type": "OnDelete"}
    rolling: dict[str, Any] = {"partition": 0}
    rolling["maxUnavailable"] = spec.rollout.max_unavailable if spec.rollout.max_unavailable is not None else 1
    return {"type": "RollingUpdate", "rollingUpdate": rolling}


def build_statefulset(owner: Owner, spec: DLODeploymentSpec, mode: Mode,
                      ctx: BuildContext = BuildContext()) -> dict[str, Any]:
    metadata = meta(owner, owner.name)
    # the model (and adapters) its pods run, read back while a new uri is fetched before they move to it
    metadata["annotations"] = {MODEL_SOURCE_ANNOTATION: spec.model.model_dump_json(by_alias=True, exclude_none=True)}
    if spec.lora is not None:
        metadata["annotations"][LORA_SOURCE_ANNOTATION] = spec.lora.model_dump_json(by_alias=True, exclude_none=True)
    if ctx.network_policy is not None:  # read back to delete the policy once the operator makes none
        metadata["annotations"][NETWORK_POLICY_ANNOTATION] = "true"
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata,
        "spec": {
            "replicas": spec.replicas,
            "serviceName": headless_service_name(owner.name),
            # Pods of one deployment are independent node groups: start and replace them together.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(owner.name)},
            "updateStrategy": update_strategy(spec),
            "template": pod_template(owner, spec, mode, ctx),
        },
    }


def _service_ports(spec: DLODeploymentSpec) -> list[dict[str, Any]]:
    return [{"name": HTTP_PORT_NAME, "port": spec.service.port, "targetPort": HTTP_PORT_NAME, "protocol": "TCP"}]


def build_headless_service(owner: Owner, spec: DLODeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(owner, headless_service_name(owner.name), {"dlo.dev/service": "headless"}),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(owner.name),
            "ports": _service_ports(spec),
        },
    }


def build_client_service(owner: Owner, spec: DLODeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(owner, owner.name, {"dlo.dev/service": "client"}),
        "spec": {"type": spec.service.type, "selector": selector_labels(owner.name), "ports": _service_ports(spec)},
    }


def build_pdb(owner: Owner, spec: DLODeploymentSpec) -> dict[str, Any]:
    unavailable = spec.rollout.max_unavailable if spec.rollout.type == "RollingUpdate" else None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta(owner, owner.name),
        "spec": {
            "maxUnavailable": unavailable if unavailable is not None else 1,
            "selector": {"matchLabels": selector_labels(owner.name)},
        },
    }


# The target labels the dashboards and alert rules select on (charts/dlo/rules, charts/dlo/dashboards):
# the DLODeployment, the node and one job name, besides the namespace and pod every monitor adds.
# The same list as the chart's PodMonitor (charts/dlo/templates/monitoring.yaml); a test holds them
# equal, so a DLODeployment's own monitor and the chart's label its engines alike.
ENGINE_RELABELINGS: tuple[dict[str, Any], ...] = (
    {"sourceLabels": ["__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", INSTANCE)],
     "targetLabel": "deployment"},
    {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"},
    {"targetLabel": "job", "replacement": "dlo-engine"},
)


def build_monitor(owner: Owner, spec: DLODeploymentSpec, ctx: BuildContext = BuildContext()) -> dict[str, Any]:
    endpoint = {
        "port": HTTP_PORT_NAME, "path": "/metrics", "interval": spec.monitoring.interval,
        "relabelings": [dict(r) for r in ENGINE_RELABELINGS],
    }
    body: dict[str, Any]
    if spec.monitoring.kind == "PodMonitor":
        body = {"selector": {"matchLabels": selector_labels(owner.name)}, "podMetricsEndpoints": [endpoint]}
    else:
        selector = {**selector_labels(owner.name), "dlo.dev/service": "client"}
        body = {"selector": {"matchLabels": selector}, "endpoints": [endpoint]}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": spec.monitoring.kind,
        # kube-prometheus-stack selects monitors by `release: <its release>` (--monitoring-release)
        "metadata": meta(owner, owner.name, {**({"release": ctx.monitoring_release} if ctx.monitoring_release else {}),
                                             **spec.monitoring.labels}),
        "spec": body,
    }


def build_all(owner: Owner, spec: DLODeploymentSpec, mode: Mode, monitor_crd_exists: bool,
              ctx: BuildContext = BuildContext(), pods_spec: DLODeploymentSpec | None = None) -> list[dict[str, Any]]:
    """Every object the operator keeps for one DLODeployment, in apply order. `pods_spec`: the spec
    the pods run when it is not `spec` (the previous model while a new one is fetched)."""
    objects = [
        build_headless_service(owner, spec),
        build_client_service(owner, spec),
        build_pdb(owner, spec),
        build_statefulset(owner, pods_spec or spec, mode, ctx),
    ]
    if spec.monitoring.enabled and monitor_crd_exists:
        objects.append(build_monitor(owner, spec, ctx))
    if (policy := build_network_policy(owner, spec, ctx)) is not None:
        objects.append(policy)
    if (autoscaler := build_autoscaler(owner, spec, ctx)) is not None:
        objects.append(autoscaler)
    return objects
