"""charts/dlo: rendered and linted with the real Helm engine (Helm's Go SDK), for the default values
and for a values file that turns every option on; built-in objects strictly valid Kubernetes."""

import json
import shutil
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from dlo.operator.cli import crd_yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "dlo"
VALUES = {
    "default": None,
    "all-on": yaml.safe_load((ROOT / "examples" / "values-all-on.yaml").read_text()),
    "minimal": yaml.safe_load((ROOT / "examples" / "values-minimal.yaml").read_text()),
}
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def render(values, chart: Path = CHART) -> list[dict]:
    out = helm.Chart.load(str(chart)).render(values, name="dlo", namespace="dlo-system")
    return [doc for text in out.values() for doc in yaml.safe_load_all(text) if doc]


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


@pytest.mark.parametrize("case", VALUES)
def test_chart_lints_clean(case):
    report = helm.lint(str(CHART), VALUES[case], strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


@pytest.mark.parametrize("case", VALUES)
def test_rendered_builtin_objects_are_strictly_valid(case):
    objs = render(VALUES[case])
    assert objs
    for obj in objs:
        if obj["kind"] not in MONITORING_KINDS:
            kubernetes_validate.validate(obj, "1.37.0", strict=True)


def test_default_values_render_operator_and_agent_without_monitors():
    objs = render(None)
    kinds = sorted({o["kind"] for o in objs} - {"ConfigMap"})
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "DaemonSet", "Deployment", "Service", "ServiceAccount"]
    # one dashboard ConfigMap per dashboards/*.json shipped in the chart (dashboards are on by default)
    assert len(by_kind(objs, "ConfigMap")) == len(list((CHART / "dashboards").glob("*.json")))
    (deploy,) = by_kind(objs, "Deployment")
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"] == {"type": "Recreate"}
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["operator", "run"] and not any(a.startswith("--namespace") for a in args)


def test_all_on_renders_monitors_namespaces_and_agent_options():
    objs = render(VALUES["all-on"])
    (sm,) = by_kind(objs, "ServiceMonitor")
    (pm,) = by_kind(objs, "PodMonitor")
    for monitor in (sm, pm):
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/part-of": "dlo", "app.kubernetes.io/component": "engine"}
    args = by_kind(objs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=serving" in args and "--namespace=staging" in args
    agent = by_kind(objs, "DaemonSet")[0]["spec"]["template"]["spec"]
    agent_args = agent["containers"][0]["args"]
    assert "--warm" in agent_args and "--calibration=/calibration/calibration.json" in agent_args
    assert {"name": "models", "hostPath": {"path": "/mnt/models", "type": "DirectoryOrCreate"}} in agent["volumes"]


def test_agent_daemonset_reads_the_host_read_only():
    (ds,) = by_kind(render(None), "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    for name in ("proc", "cgroup", "sys", "models"):
        assert mounts[name]["readOnly"] is True
    sc = pod["containers"][0]["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE", "DAC_READ_SEARCH"]}
    args = pod["containers"][0]["args"]
    assert args[0] == "agent" and "--proc-root=/host/proc" in args and "--cgroup-root=/host/sys/fs/cgroup" in args


def test_rbac_is_least_privilege_without_wildcards():
    roles = {r["metadata"]["name"]: r for r in by_kind(render(None), "ClusterRole")}
    for role in roles.values():
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], (role["metadata"]["name"], rule)
    agent = roles["dlo-agent"]["rules"]
    assert {(tuple(r["resources"]), tuple(r["verbs"])) for r in agent} == {(("pods",), ("list",)), (("nodes",), ("patch",))}


def allowed(role: dict, group: str, resource: str, verb: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in role["rules"])


def test_operator_role_covers_what_the_operator_does():
    (role,) = [r for r in by_kind(render(None), "ClusterRole") if r["metadata"]["name"] == "dlo-operator"]
    needed = [
        ("dlo.dev", "dlodeployments", "watch"), ("dlo.dev", "dlodeployments", "patch"),
        ("dlo.dev", "dlodeployments/status", "patch"),
        ("apps", "statefulsets", "create"), ("apps", "statefulsets", "patch"), ("apps", "statefulsets", "get"),
        ("", "services", "create"), ("", "services", "patch"),
        ("policy", "poddisruptionbudgets", "create"), ("policy", "poddisruptionbudgets", "patch"),
        ("monitoring.coreos.com", "podmonitors", "create"), ("monitoring.coreos.com", "servicemonitors", "patch"),
        ("", "pods", "list"), ("", "pods", "delete"), ("", "nodes", "list"), ("", "events", "create"),
    ]
    assert [n for n in needed if not allowed(role, *n)] == []
    assert not allowed(role, "", "secrets", "get")  # the engine pods read the API key, not the operator


def test_chart_crd_is_the_generated_one():
    assert (CHART / "crds" / "dlo.dev_dlodeployments.yaml").read_text() == crd_yaml()


def test_dashboards_and_rules_files_become_configmaps_and_a_prometheusrule(tmp_path):
    chart = tmp_path / "dlo"
    shutil.copytree(CHART, chart)
    for sub in ("dashboards", "rules"):
        shutil.rmtree(chart / sub, ignore_errors=True)
        (chart / sub).mkdir()
    dashboard = {"title": "DLO test", "panels": [{"type": "timeseries", "targets": [{"expr": "dlo_ready"}]}]}
    (chart / "dashboards" / "dlo_Test.json").write_text(json.dumps(dashboard))
    rules = {"groups": [{"name": "dlo", "rules": [{"alert": "DLONotReady", "expr": "dlo_ready == 0", "for": "5m"}]}]}
    (chart / "rules" / "dlo.yaml").write_text(yaml.safe_dump(rules))

    objs = render(VALUES["all-on"], chart)
    (cm,) = by_kind(objs, "ConfigMap")
    assert cm["metadata"]["name"] == "dlo-dashboard-dlo-test"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["dlo_Test.json"]) == dashboard
    (rule,) = by_kind(objs, "PrometheusRule")
    assert rule["spec"]["groups"] == rules["groups"]

    off = render({"dashboards": {"enabled": False}, "prometheusRule": {"enabled": False}}, chart)
    assert not by_kind(off, "ConfigMap") and not by_kind(off, "PrometheusRule")


def test_empty_dashboards_and_rules_folders_render_nothing_extra(tmp_path):
    chart = tmp_path / "dlo"
    shutil.copytree(CHART, chart)
    for sub in ("dashboards", "rules"):
        shutil.rmtree(chart / sub, ignore_errors=True)
    objs = render(VALUES["all-on"], chart)
    assert not by_kind(objs, "ConfigMap") and not by_kind(objs, "PrometheusRule")


def test_values_schema_rejects_typos_and_bad_types():
    with pytest.raises(Exception, match="(?i)additional|not allowed|operatr"):
        render({"operatr": {}})
    with pytest.raises(Exception, match="(?i)port|integer|type"):
        render({"agent": {"port": "ninety"}})
