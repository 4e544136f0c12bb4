"""The NetworkPolicy of a DLODeployment's engine pods (`dlo operator run --network-policy`; the chart's
`networkPolicy.enabled`, on by default).

Owns: `build_network_policy`. Ingress to the engine pods, on the engine's port only, from: the
DLODeployment's own namespace (clients there, and the pods of the deployment itself: a video request
is forwarded to the pod that holds the job), the namespaces the client selector matches, the pods of
the monitoring namespaces (Prometheus: `/metrics` is served on the same port) and the DLO agents
(they scrape each engine's pinned bytes). A `NodePort` or `LoadBalancer` Service takes clients from
outside the cluster, whose addresses no namespace names: its port is open to every source. Egress is
left open (stores, peers, the API server are the engine's business, not this policy's). Traffic
between a node and its pods (the kubelet's probes) is never subject to a NetworkPolicy.
Must never: call the API server, or open any port but the engine's.
"""

from __future__ import annotations

from typing import Any

from dlo.operator.models import DLODeploymentSpec
from dlo.operator.names import COMPONENT, PART_OF, BuildContext, Owner, meta, selector_labels

NAMESPACE_NAME = "kubernetes.io/metadata.name"  # the label every namespace carries (Kubernetes >= 1.21)
AGENT_LABELS = {PART_OF: "dlo", COMPONENT: "agent"}  # the chart's agent DaemonSet pods


def _peers(spec: DLODeploymentSpec, ctx: BuildContext) -> list[dict[str, Any]] | None:
    """Who may connect; None: every source (a Service reachable from outside the cluster)."""
    settings = ctx.network_policy
    assert settings is not None
    if spec.service.type != "ClusterIP":
        return None
    peers: list[dict[str, Any]] = [{"podSelector": {}}]  # the DLODeployment's own namespace
    if settings.client_namespace_selector is not None:
        peers.append({"namespaceSelector": dict(settings.client_namespace_selector)})
    if settings.monitoring_namespaces:
        peers.append({"namespaceSelector": {"matchExpressions": [
            {"key": NAMESPACE_NAME, "operator": "In", "values": sorted(settings.monitoring_namespaces)}]}})
    if settings.agent_namespace:
        peers.append({"namespaceSelector": {"matchLabels": {NAMESPACE_NAME: settings.agent_namespace}},
                      "podSelector": {"matchLabels": dict(AGENT_LABELS)}})
    return peers


def build_network_policy(owner: Owner, spec: DLODeploymentSpec, ctx: BuildContext) -> dict[str, Any] | None:
    """The policy, or None when the operator makes none (`ctx.network_policy` unset)."""
    if ctx.network_policy is None:
        return None
    rule: dict[str, Any] = {"ports": [{"protocol": "TCP", "port": spec.service.port}]}
    peers = _peers(spec, ctx)
    if peers is not None:
        rule["from"] = peers
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(owner, owner.name),
        "spec": {"podSelector": {"matchLabels": selector_labels(owner.name)}, "policyTypes": ["Ingress"],
                 "ingress": [rule]},
    }
