"""The engine pods' NetworkPolicy (`dlo operator run --network-policy`, the chart's networkPolicy):
built strictly valid for the pods the StatefulSet makes, kept by the operator on the emulated
cluster (owned, following the spec's port) and deleted once the operator runs without it; the
chart's values reach the operator's flags."""

from __future__ import annotations

from dataclasses import replace

import kubernetes_validate

from cluster import dlodeployment, running_cluster
from dlo.operator import builders, security_config
from dlo.operator.cli import _run_parser
from dlo.operator.models import parse_spec
from dlo.operator.names import BuildContext, Owner
from dlo.operator.security_config import FetchIdentity, NetworkPolicySettings
from test_chart import by_kind, render
from test_handlers import NS, SPEC, add_gpu_nodes

OWNER = Owner("wan", "serving")
SETTINGS = NetworkPolicySettings(None, ("monitoring",), "dlo-system")


def policy_of(spec: dict, settings: NetworkPolicySettings | None = SETTINGS) -> tuple[dict | None, dict]:
    objs = builders.build_all(OWNER, parse_spec(spec), "allgather", True, BuildContext(network_policy=settings))
    (sts,) = [o for o in objs if o["kind"] == "StatefulSet"]
    return next((o for o in objs if o["kind"] == "NetworkPolicy"), None), sts


def test_the_policy_admits_the_engine_port_from_the_namespace_monitoring_and_agents_only():
    policy, sts = policy_of({**SPEC, "service": {"port": 8100}})
    assert policy is not None
    kubernetes_validate.validate(policy, "1.37.0", strict=True)
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress (stores, peers) is not this policy's
    (rule,) = policy["spec"]["ingress"]
    engine = sts["spec"]["template"]["spec"]["containers"][0]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8100}] == [
        {"protocol": p["protocol"], "port": p["containerPort"]} for p in engine["ports"]]
    assert rule["from"] == [
        {"podSelector": {}},  # the DLODeployment's own namespace: its clients and its own pods (forwarded videos)
        {"namespaceSelector": {"matchExpressions": [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring"]}]}},
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "dlo-system"}},
         "podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "dlo", "app.kubernetes.io/component": "agent"}}},
    ]
    assert sts["metadata"]["annotations"][builders.NETWORK_POLICY_ANNOTATION] == "true"


def test_client_namespaces_by_selector_and_an_external_service_open_to_every_source():
    team = NetworkPolicySettings({"matchLabels": {"dlo.dev/client": "true"}})
    policy, _ = policy_of(SPEC, team)
    assert policy is not None and policy["spec"]["ingress"][0]["from"] == [
        {"podSelector": {}}, {"namespaceSelector": {"matchLabels": {"dlo.dev/client": "true"}}}]
    for kind in ("LoadBalancer", "NodePort"):  # clients from outside the cluster: no namespace names them
        policy, _ = policy_of({**SPEC, "service": {"type": kind}})
        assert policy is not None and policy["spec"]["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8000}]}]
    policy, sts = policy_of(SPEC, None)
    assert policy is None and builders.NETWORK_POLICY_ANNOTATION not in sts["metadata"]["annotations"]


def test_the_charts_values_reach_the_operator_flags():
    def settings(values: dict | None) -> security_config.SecuritySettings:
        (deploy,) = by_kind(render(values), "Deployment")
        args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
        return security_config.from_args(_run_parser().parse_args(args[2:]))

    assert settings(None) == security_config.SecuritySettings(SETTINGS, FetchIdentity(10001, 10001, "chown"))
    chosen = settings({"networkPolicy": {"clientNamespaceSelector": {"matchExpressions": [
        {"key": "team", "operator": "In", "values": ["ml"]}]}, "monitoringNamespaces": ["prom", "obs"]},
        "agent": {"enabled": False}, "operator": {"fetch": {"runAsUser": 2000, "runAsGroup": 3000,
                                                            "cacheOwnership": "preset"}}})
    assert chosen == security_config.SecuritySettings(
        NetworkPolicySettings({"matchExpressions": [{"key": "team", "operator": "In", "values": ["ml"]}]},
                              ("prom", "obs"), ""), FetchIdentity(2000, 3000, "preset"))
    assert settings({"networkPolicy": {"enabled": False}}).network_policy is None


async def test_the_operator_keeps_the_policy_and_deletes_it_once_turned_off():
    async with running_cluster(network_policy=SETTINGS) as cluster:
        await add_gpu_nodes(cluster, count=1)
        await cluster.create(dlodeployment("wan", NS, {**SPEC, "replicas": 1}))
        policy = await cluster.wait(lambda: cluster.get("NetworkPolicy", NS, "wan"), what="the NetworkPolicy")
        (owner,) = policy["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"]) == ("DLODeployment", "wan")
        await cluster.patch_dlod(NS, "wan", {"spec": {"service": {"port": 8100}}})
        await cluster.wait(lambda: cluster.get("NetworkPolicy", NS, "wan")["spec"]["ingress"][0]["ports"][0]["port"]
                           == 8100, what="the policy follows the port")
        await cluster.stop_operator()
        cluster.config = replace(cluster.config, network_policy=None)
        cluster.start_operator()
        await cluster.wait(lambda: not cluster.get("NetworkPolicy", NS, "wan"), what="the policy deleted")
        await cluster.wait(lambda: builders.NETWORK_POLICY_ANNOTATION not in (
            cluster.get("StatefulSet", NS, "wan")["metadata"].get("annotations") or {}), what="the mark removed")
