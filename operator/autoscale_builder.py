"""The autoscaling object of a DLODeployment (`spec.autoscaling`): a KEDA ScaledObject when KEDA's
CRD is installed, else an autoscaling/v2 HorizontalPodAutoscaler on an external metric. Both target
the DLODeployment's scale subresource: they write `spec.replicas`, the operator does the rest.

Owns: `autoscaler_kind` (which object, from the spec and whether KEDA is installed), `load_query`
(the Prometheus query: requests waiting or running, per DLODeployment), the per-pod target (the target per rank times the ranks of a pod: both autoscalers average the metric
over the current replicas), `build_scaled_object`, `build_hpa`.
Must never: call the API server, or scale a StatefulSet directly (the operator owns it).
"""

from __future__ import annotations

from typing import Any, Literal

from dlo.operator.models import API_VERSION, KIND, DLODeploymentSpec
from dlo.operator.names import BuildContext, Owner, meta

# The external metric an HPA reads: a prometheus-adapter rule serves it (docs/operator.md).
EXTERNAL_METRIC = "dlo_engine_load"
SCALE_DOWN_PODS_PER_MINUTE = 1  # accelerator nodes are few and slow to come back: one at a time


def load_query(owner: Owner) -> str:
    """Requests waiting for a wave plus requests running, summed over the DLODeployment's engines
    (0 when none reports: KEDA refuses an empty result)."""
    sel = f'namespace="{owner.namespace}",deployment="{owner.name}"'
    return (f"(sum(dlo_queue_depth{{{sel}}}) or vector(0)) + "
            f"(sum(dlo_requests_running{{{sel}}}) or vector(0))")


def per_pod_target(spec: DLODeploymentSpec) -> float:
    return spec.autoscaling.target_queue_depth_per_rank * spec.devices_per_node


def _quantity(value: float) -> str:
    return f"{round(value * 1000)}m"


def _target_ref(owner: Owner) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": owner.name}


def _behavior(spec: DLODeploymentSpec) -> dict[str, Any]:
    return {"scaleDown": {"stabilizationWindowSeconds": spec.autoscaling.scale_down_stabilization_seconds,
                          "policies": [{"type": "Pods", "value": SCALE_DOWN_PODS_PER_MINUTE, "periodSeconds": 60}]}}


def build_scaled_object(owner: Owner, spec: DLODeploymentSpec, ctx: BuildContext) -> dict[str, Any]:
    a = spec.autoscaling
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": meta(owner, owner.name),
        "spec": {
            "scaleTargetRef": _target_ref(owner),
            "minReplicaCount": a.min_replicas,
            "maxReplicaCount": a.max_replicas,
            "cooldownPeriod": a.scale_down_stabilization_seconds,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(spec)}},
            "triggers": [{"type": "prometheus", "metricType": "AverageValue", "metadata": {
                "serverAddress": ctx.prometheus_url, "query": load_query(owner),
                "threshold": f"{per_pod_target(spec):g}"}}],
        },
    }


def build_hpa(owner: Owner, spec: DLODeploymentSpec) -> dict[str, Any]:
    a = spec.autoscaling
    selector = {"matchLabels": {"namespace": owner.namespace, "deployment": owner.name}}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": meta(owner, owner.name),
        "spec": {
            "scaleTargetRef": _target_ref(owner),
            "minReplicas": a.min_replicas,  # at least 1 (CEL): nothing scales up from zero
            "maxReplicas": a.max_replicas,
            "metrics": [{"type": "External", "external": {
                "metric": {"name": EXTERNAL_METRIC, "selector": selector},
                "target": {"type": "AverageValue", "averageValue": _quantity(per_pod_target(spec))}}}],
            "behavior": _behavior(spec),
        },
    }


def autoscaler_kind(spec: DLODeploymentSpec, keda_installed: bool) -> Literal["keda", "hpa"] | None:
    """Which autoscaling object `spec.autoscaling` gets: KEDA's where its CRD is installed (engine
    auto or keda), an HPA for engine hpa or without KEDA (engine auto), none for engine keda without
    KEDA (the status warns) or with autoscaling off."""
    if not spec.autoscaling.enabled:
        return None
    if spec.autoscaling.engine == "keda":
        return "keda" if keda_installed else None
    return "keda" if keda_installed and spec.autoscaling.engine == "auto" else "hpa"


def build_autoscaler(owner: Owner, spec: DLODeploymentSpec, ctx: BuildContext) -> dict[str, Any] | None:
    if not spec.autoscaling.enabled or ctx.autoscaler is None:
        return None
    return build_scaled_object(owner, spec, ctx) if ctx.autoscaler == "keda" else build_hpa(owner, spec)
