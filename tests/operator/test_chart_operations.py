"""The chart's cluster operations: the agent's placement, roles per watched namespace, the
monitoring release label and runbook prefix, and the Kubernetes version it needs."""

import yaml

from test_chart import CHART, by_kind, named, notes, render


def test_agent_runs_on_accelerator_nodes_only_by_default_and_everywhere_when_asked():
    (ds,) = by_kind(render(None), "DaemonSet")
    terms = ds["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert [t["matchExpressions"][0]["key"] for t in terms["nodeSelectorTerms"]] == ["nvidia.com/gpu.present",
                                                                                     "accelerator"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["true"]
    (ds,) = by_kind(render({"agent": {"acceleratorNodeLabels": []}}), "DaemonSet")
    assert "affinity" not in ds["spec"]["template"]["spec"]
    (ds,) = by_kind(render({"agent": {"modelsRoot": ""}}), "DaemonSet")  # no model folders: no mount at all
    assert "models" not in {v["name"] for v in ds["spec"]["template"]["spec"]["volumes"]}


def test_watched_namespaces_get_roles_and_the_cluster_role_keeps_only_cluster_wide_rules():
    objs = render({"operator": {"watchNamespaces": ["serving", "staging"]}})
    roles = {r["metadata"]["namespace"]: r for r in by_kind(objs, "Role") if r["metadata"]["name"] == "dlo-operator"}
    assert set(roles) == {"serving", "staging"}
    bindings = {b["metadata"]["namespace"]: b for b in by_kind(objs, "RoleBinding")
                if b["metadata"]["name"] == "dlo-operator"}
    assert bindings["serving"]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                              "name": "dlo-operator"}
    assert bindings["serving"]["subjects"] == [{"kind": "ServiceAccount", "name": "dlo-operator",
                                                "namespace": "dlo-system"}]
    cluster = named(objs, "ClusterRole", "dlo-operator")
    assert {r for rule in cluster["rules"] for r in rule["resources"]} == {
        "nodes", "customresourcedefinitions", "namespaces"}
    assert "dlodeployments" in {r for rule in roles["serving"]["rules"] for r in rule["resources"]}


def test_monitoring_release_labels_every_monitor_and_rule_and_runbooks_follow_the_prefix():
    values = {"monitoring": {"release": "kps", "runbookUrl": "https://wiki.example/dlo"},
              "serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True},
              "prometheusRule": {"enabled": True}, "operator": {"watchNamespaces": ["serving"]}}
    objs = render(values)
    monitors = by_kind(objs, "ServiceMonitor") + by_kind(objs, "PodMonitor") + by_kind(objs, "PrometheusRule")
    assert len(monitors) == 4 and all(m["metadata"]["labels"]["release"] == "kps" for m in monitors)
    (pm,) = by_kind(objs, "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["serving"]}
    (rule,) = by_kind(objs, "PrometheusRule")
    urls = [r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"]]
    assert urls and all(u.startswith("https://wiki.example/dlo#") for u in urls)
    args = by_kind(objs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--monitoring-release=kps" in args  # the operator's own monitors of DLODeployments too
    (pm,) = by_kind(render({"podMonitor": {"enabled": True}}), "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == {"any": True} and "release" not in pm["metadata"]["labels"]
    assert "monitoring.release is empty" in notes({"podMonitor": {"enabled": True}})
    assert "monitoring.release is empty" not in notes(values)


def test_chart_needs_kubernetes_1_25():
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"] == ">=1.25.0-0"
