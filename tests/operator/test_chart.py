"""charts/dlo: rendered and linted with the real Helm engine (Helm's Go SDK), for the default values
and for a values file that turns every option on; built-in objects strictly valid Kubernetes."""

import json
import os
import shutil
import subprocess
import sys
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
RULE_FILES = sorted((CHART / "rules").glob("*.yaml")) + sorted((CHART / "rules" / "operator").glob("*.yaml"))
RULE_TESTS = sorted((CHART / "rules" / "tests").glob("*.yaml")) + sorted(
    (CHART / "rules" / "operator" / "tests").glob("*.yaml"))


def render(values, chart: Path = CHART) -> list[dict]:
    out = helm.Chart.load(str(chart)).render(values, name="dlo", namespace="dlo-system")
    # NOTES.txt is text for the user, not manifests (Helm prints it, never applies it)
    return [doc for path, text in out.items() if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def named(objs: list[dict], kind: str, name: str) -> dict:
    (obj,) = [o for o in by_kind(objs, kind) if o["metadata"]["name"] == name]
    return obj


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
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "DaemonSet", "Deployment", "PodDisruptionBudget", "Role",
                     "RoleBinding", "Service", "ServiceAccount", "ValidatingAdmissionPolicy",
                     "ValidatingAdmissionPolicyBinding"]
    # one dashboard ConfigMap per dashboards/*.json shipped in the chart (dashboards are on by default)
    assert len(by_kind(objs, "ConfigMap")) == len(list((CHART / "dashboards").glob("*.json")))
    (deploy,) = by_kind(objs, "Deployment")
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["operator", "run"] and not any(a.startswith("--namespace") for a in args)


def test_two_operator_replicas_by_default_with_leader_election():
    """Two replicas, the one holding the Lease reconciles (`--leader-elect`, the Lease named after the
    release's operator, in its namespace from the downward API); a rollout starts the standby first;
    the replicas spread over nodes and a drain keeps one; the Role grants the lease and nothing else."""
    objs = render(None)
    (deploy,) = by_kind(objs, "Deployment")
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "--leader-elect" in container["args"] and "--lease-name=dlo-operator" in container["args"]
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}
    assert env["POD_NAME"] == "metadata.name" and env["POD_NAMESPACE"] == "metadata.namespace"
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["whenUnsatisfiable"] == "ScheduleAnyway"
    pdb = named(objs, "PodDisruptionBudget", "dlo-operator")
    assert pdb["spec"]["minAvailable"] == 1
    assert all(deploy["spec"]["template"]["metadata"]["labels"][k] == v
               for k, v in pdb["spec"]["selector"]["matchLabels"].items())
    role = named(objs, "Role", "dlo-operator-lease")
    assert role["metadata"]["namespace"] == "dlo-system" and role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "patch"]}]
    binding = named(objs, "RoleBinding", "dlo-operator-lease")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "dlo-operator", "namespace": "dlo-system"}]
    one = render({"operator": {"replicas": 1}})
    assert not by_kind(one, "PodDisruptionBudget") and "topologySpreadConstraints" not in by_kind(
        one, "Deployment")[0]["spec"]["template"]["spec"]


def test_all_on_renders_monitors_namespaces_and_agent_options():
    objs = render(VALUES["all-on"])
    sm = named(objs, "ServiceMonitor", "dlo-agent")
    (pm,) = by_kind(objs, "PodMonitor")
    for monitor in (sm, named(objs, "ServiceMonitor", "dlo-operator"), pm):
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/part-of": "dlo", "app.kubernetes.io/component": "engine"}
    args = by_kind(objs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=serving" in args and "--namespace=staging" in args
    agent = by_kind(objs, "DaemonSet")[0]["spec"]["template"]["spec"]
    agent_args = agent["containers"][0]["args"]
    assert "--warm" in agent_args and "--calibration=/calibration/calibration.json" in agent_args
    assert {"name": "models", "hostPath": {"path": "/mnt/models", "type": "Directory"}} in agent["volumes"]
    # the agent creates nothing on the node; only a fetch (the operator's Jobs) creates the cache folder
    assert not [v for o in objs for v in o.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", [])
                if v.get("hostPath", {}).get("type") == "DirectoryOrCreate"]
    op_args = by_kind(objs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--cache-root=/mnt/models" in op_args  # fetched models land where the agent looks


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
    assert {(tuple(r["resources"]), tuple(r["verbs"])) for r in agent} == {(("pods",), ("list", "watch")), (("nodes",), ("patch",))}


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


def pod_spec(objs: list[dict], kind: str) -> dict:
    (obj,) = by_kind(objs, kind)
    return obj["spec"]["template"]


def test_name_overrides_rename_every_object():
    objs = render({"fullnameOverride": "serving-stack"})
    named = [o["metadata"]["name"] for o in objs if o["kind"] != "ConfigMap"]
    assert named and all(n.startswith("serving-stack-") for n in named), named
    objs = render({"nameOverride": "offload"})
    assert {o["metadata"]["name"] for o in by_kind(objs, "DaemonSet")} == {"dlo-offload-agent"}
    assert all(o["metadata"]["labels"]["app.kubernetes.io/name"] == "offload" for o in objs)
    with pytest.raises(Exception, match="(?i)fullnameOverride|pattern|does not match"):
        render({"fullnameOverride": "Not_A_DNS_Name"})


@pytest.mark.parametrize("component, kind", [("operator", "Deployment"), ("agent", "DaemonSet")])
def test_service_accounts_are_configurable_per_component(component, kind):
    values = {component: {"serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"}}}}
    objs = render(values)
    (sa,) = [s for s in by_kind(objs, "ServiceAccount") if s["metadata"]["name"] == f"dlo-{component}"]
    assert sa["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/x"}
    assert pod_spec(objs, kind)["spec"]["serviceAccountName"] == f"dlo-{component}"

    # not created: the pods and the binding use the given (existing) account
    objs = render({component: {"serviceAccount": {"create": False, "name": "platform-sa"}}})
    assert f"dlo-{component}" not in [s["metadata"]["name"] for s in by_kind(objs, "ServiceAccount")]
    assert pod_spec(objs, kind)["spec"]["serviceAccountName"] == "platform-sa"
    (binding,) = [b for b in by_kind(objs, "ClusterRoleBinding") if b["metadata"]["name"] == f"dlo-{component}"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "platform-sa", "namespace": "dlo-system"}]


def test_rbac_create_false_renders_no_roles_or_bindings():
    objs = render({"rbac": {"create": False}})
    assert not by_kind(objs, "ClusterRole") and not by_kind(objs, "ClusterRoleBinding")
    assert {s["metadata"]["name"] for s in by_kind(objs, "ServiceAccount")} == {"dlo-operator", "dlo-agent"}
    for obj in objs:
        kubernetes_validate.validate(obj, "1.37.0", strict=True)


@pytest.mark.parametrize("component, kind", [("operator", "Deployment"), ("agent", "DaemonSet")])
def test_pod_metadata_security_contexts_and_extras_reach_the_pods(component, kind):
    values = {component: {
        "podAnnotations": {"example.com/a": "1"},
        "podLabels": {"team": "ml"},
        "podSecurityContext": {"fsGroup": 2000},
        "securityContext": {"runAsGroup": 3000},
        "extraEnv": [{"name": "EXTRA", "value": "x"}],
        "extraVolumes": [{"name": "extra", "emptyDir": {}}],
        "extraVolumeMounts": [{"name": "extra", "mountPath": "/extra"}],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}}},
        "tolerations": [{"key": "gpu", "operator": "Exists"}],
        "nodeSelector": {"pool": "gpu"},
    }}
    objs = render(values)
    template = pod_spec(objs, kind)
    pod, (container,) = template["spec"], template["spec"]["containers"]
    assert template["metadata"]["annotations"] == {"example.com/a": "1"}
    assert template["metadata"]["labels"]["team"] == "ml"
    assert template["metadata"]["labels"]["app.kubernetes.io/component"] == component  # chart labels stay
    # maps merge with the defaults (Helm's values merge), so the hardening stays unless set to null
    assert pod["securityContext"]["fsGroup"] == 2000 and pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"]["runAsGroup"] == 3000
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert {"name": "EXTRA", "value": "x"} in container["env"]
    assert {"name": "extra", "emptyDir": {}} in pod["volumes"]
    assert {"name": "extra", "mountPath": "/extra"} in container["volumeMounts"]
    assert pod["affinity"] == values[component]["affinity"]
    assert pod["tolerations"] == values[component]["tolerations"]
    assert pod["nodeSelector"] == {"pool": "gpu"}
    for obj in objs:
        if obj["kind"] not in MONITORING_KINDS:
            kubernetes_validate.validate(obj, "1.37.0", strict=True)


def test_default_security_contexts_are_unchanged_by_the_values_keys():
    objs = render(None)
    operator = pod_spec(objs, "Deployment")["spec"]
    assert operator["securityContext"] == {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                                           "seccompProfile": {"type": "RuntimeDefault"}}
    assert operator["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    agent = pod_spec(objs, "DaemonSet")["spec"]
    assert agent["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert agent["containers"][0]["securityContext"]["runAsUser"] == 0


def operator_env(objs: list[dict]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in pod_spec(objs, "Deployment")["spec"]["containers"][0]["env"]}


def test_engine_image_default_reaches_the_operator():
    assert operator_env(render(None))["DLO_DEFAULT_ENGINE_IMAGE"] == "ghcr.io/dlo-dev/dlo:0.1.0"
    env = operator_env(render({"engine": {"image": {"repository": "registry.example.com/dlo", "tag": "1.2.3"}}}))
    assert env["DLO_DEFAULT_ENGINE_IMAGE"] == "registry.example.com/dlo:1.2.3"
    assert operator_env(render(VALUES["all-on"]))["DLO_DEFAULT_ENGINE_IMAGE"] == "registry.example.com/dlo/dlo:0.1.0"


def test_agent_port_is_not_dcgm_exporters():
    objs = render(None)
    (container,) = pod_spec(objs, "DaemonSet")["spec"]["containers"]
    assert container["ports"] == [{"name": "metrics", "containerPort": 9435}]
    assert "--port=9435" in container["args"]
    (svc,) = [s for s in by_kind(objs, "Service") if s["metadata"]["name"] == "dlo-agent"]
    assert svc["spec"]["ports"][0]["port"] == 9435
    assert yaml.safe_load((CHART / "values.yaml").read_text())["agent"]["port"] != 9400  # dcgm-exporter's


def test_dashboard_folder_is_an_annotation():
    objs = render(VALUES["all-on"])
    for cm in by_kind(objs, "ConfigMap"):
        assert cm["metadata"]["annotations"] == {"grafana_folder": "DLO"}
        assert "grafana_folder" not in cm["metadata"]["labels"]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_monitors_label_targets_as_the_dashboards_and_rules_expect():
    objs = render(VALUES["all-on"])
    sm = named(objs, "ServiceMonitor", "dlo-agent")
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True  # dlo_pod_* keep the engine pod's namespace and pod
    assert {"targetLabel": "job", "replacement": "dlo-agent"} in endpoint["relabelings"]
    assert {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"} in endpoint["relabelings"]
    (pm,) = by_kind(objs, "PodMonitor")
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    targets = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert targets["job"]["replacement"] == "dlo-engine"
    assert targets["deployment"]["sourceLabels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"]
    assert targets["node"]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]


@pytest.mark.parametrize("values, where", [
    ({"operator": {"serviceAccount": {"craete": True}}}, "/operator/serviceAccount"),
    ({"agent": {"extraVolumeMounts": [{"name": "x"}]}}, "/agent/extraVolumeMounts/0"),  # no mountPath
    ({"agent": {"extraEnv": [{"value": "x"}]}}, "/agent/extraEnv/0"),  # no name
    ({"dashboards": {"annotations": {"grafana_folder": 1}}}, "/dashboards/annotations/grafana_folder"),
    ({"rbac": {"create": "yes"}}, "/rbac/create"),
    ({"engine": {"image": {"repository": ""}}}, "/engine/image/repository"),
])
def test_values_schema_rejects_malformed_new_keys(values, where):
    with pytest.raises(Exception, match=f"(?s)don't meet the specifications of the schema.*at '{where}'"):
        render(values)


def notes(values) -> str:
    return helm.Chart.load(str(CHART)).render(values, name="dlo", namespace="dlo-system")["dlo/templates/NOTES.txt"]


@pytest.mark.parametrize("case", VALUES)
def test_notes_say_what_was_installed_and_what_to_do_next(case):
    text = notes(VALUES[case])
    values = VALUES[case] or {}
    assert 'release "dlo" in namespace "dlo-system"' in text
    assert "kubectl apply -n <namespace> -f -" in text and "kind: DLODeployment" in text
    assert "examples/" not in text  # the chart ships no examples folder
    manifest = yaml.safe_load(text.split("cat <<EOF | kubectl apply -n <namespace> -f -", 1)[1].split("EOF", 1)[0])
    from dlo.operator.models import parse_spec

    parse_spec(manifest["spec"])  # the manifest NOTES show is a valid DLODeployment
    agent_enabled = values.get("agent", {}).get("enabled", True)
    assert ("pod-security.kubernetes.io/enforce=privileged" in text) == agent_enabled
    assert "kubectl get dlod -A" in text and "kubectl describe dlod" in text
    agent_on = values.get("agent", {}).get("enabled", True)
    assert ("DaemonSet dlo-agent" in text) == agent_on
    assert ("fall back to allgather" in text) == (not agent_on)
    assert ("PodMonitor dlo-engines" in text) == values.get("podMonitor", {}).get("enabled", False)
    assert ("grafana_dashboard" in text) == values.get("dashboards", {}).get("enabled", True)
    assert "never upgrades" in text
    watched = values.get("operator", {}).get("watchNamespaces")
    assert (f"The operator only watches {', '.join(watched)}" in text) if watched else ("only watches" not in text)


def test_notes_and_readme_ship_a_crd_upgrade_that_applies_the_generated_crd():
    """Helm never upgrades crds/: NOTES.txt and the README give commands; what they apply is the CRD."""
    readme = (CHART / "README.md").read_text()
    chart_apply = "kubectl apply --server-side --force-conflicts -f charts/dlo/crds/"
    cli_apply = "dlo crd | kubectl apply --server-side --force-conflicts -f -"
    for text in (notes(None), readme):
        assert chart_apply in text and cli_apply in text
    # what `kubectl apply -f charts/dlo/crds/` reads: one strictly valid CRD, the generated one
    files = list((ROOT / "charts" / "dlo" / "crds").iterdir())
    docs = [d for f in files for d in yaml.safe_load_all(f.read_text()) if d]
    assert [d["metadata"]["name"] for d in docs] == ["dlodeployments.dlo.dev"]
    kubernetes_validate.validate(docs[0], "1.37.0", strict=True)
    # what `dlo crd |` pipes: the same object
    out = subprocess.run([sys.executable, "-m", "dlo.cli.main", "crd"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert list(yaml.safe_load_all(out.stdout)) == docs


def test_monitor_relabelings_are_appended_after_the_charts_own():
    objs = render(VALUES["all-on"])
    for component in ("agent", "operator"):
        sm = named(objs, "ServiceMonitor", f"dlo-{component}")
        relabelings = sm["spec"]["endpoints"][0]["relabelings"]
        assert relabelings[-1] == {"sourceLabels": ["__meta_kubernetes_pod_label_topology_kubernetes_io_zone"], "targetLabel": "zone"}
        assert relabelings[-2] == {"targetLabel": "job", "replacement": f"dlo-{component}"}
    (pm,) = by_kind(objs, "PodMonitor")
    assert pm["spec"]["podMetricsEndpoints"][0]["metricRelabelings"] == [
        {"sourceLabels": ["__name__"], "regex": "python_gc_.*", "action": "drop"}]


def test_readme_values_table_names_every_value():
    rows = [line for line in (CHART / "README.md").read_text().splitlines() if line.startswith("| `")]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    missing = []
    for key, value in values.items():
        if isinstance(value, dict):
            for child in value:
                # "`operator.serviceAccount.create`, ..." or "`operator.podAnnotations`, `podLabels`"
                cells = [row.split("|")[1] for row in rows]
                if not any(f"`{key}.{child}" in c or (f"`{key}." in c and f"`{child}`" in c) for c in cells):
                    missing.append(f"{key}.{child}")
        elif not any(f"`{key}`" in row.split("|")[1] for row in rows):
            missing.append(key)
    assert not missing, missing


def test_rendered_prometheusrule_holds_the_rule_files_and_passes_their_unit_tests(tmp_path):
    """What the PrometheusRule carries is what promtool checked: multi-line expressions and templated
    annotations survive Helm's fromYaml/toYaml round trip."""
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing (Debian's prometheus package)"
    (rule,) = by_kind(render(VALUES["all-on"]), "PrometheusRule")
    files = sorted(RULE_FILES, key=lambda f: str(f.relative_to(CHART)))
    assert rule["spec"]["groups"] == [g for f in files for g in yaml.safe_load(f.read_text())["groups"]]
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    for test_file in RULE_TESTS:
        doc = yaml.safe_load(test_file.read_text())
        doc["rule_files"] = [str(rendered)]
        (tmp_path / test_file.name).write_text(yaml.safe_dump(doc))
        r = subprocess.run([promtool, "test", "rules", str(tmp_path / test_file.name)], capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr


def test_operator_metrics_port_is_served_named_and_scraped_as_dlo_operator():
    from dlo.operator import cli as operator_cli
    from dlo.operator import metrics

    objs = render(VALUES["all-on"])
    container = pod_spec(objs, "Deployment")["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": 8081} in container["ports"]
    assert "--metrics-port=8081" in container["args"]
    assert metrics.METRICS_PORT == operator_cli.METRICS_PORT == 8081  # what the operator serves by default
    svc = named(objs, "Service", "dlo-operator")
    pod_labels = pod_spec(objs, "Deployment")["metadata"]["labels"]
    assert all(pod_labels[k] == v for k, v in svc["spec"]["selector"].items())
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 8081, "targetPort": "metrics"}]
    sm = named(objs, "ServiceMonitor", "dlo-operator")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"  # serviceMonitor.additionalLabels
    assert all(svc["metadata"]["labels"][k] == v for k, v in sm["spec"]["selector"]["matchLabels"].items())
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert {"targetLabel": "job", "replacement": "dlo-operator"} in endpoint["relabelings"]
    # the alert selects what the monitor sets
    rules = yaml.safe_load((CHART / "rules" / "dlo-alerts.yaml").read_text())
    exprs = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    assert exprs["DLOOperatorDown"] == 'up{job="dlo-operator"} == 0'


def test_operator_service_monitor_follows_the_switches():
    # the Service is always there (any scraper); the ServiceMonitor only with serviceMonitor.enabled
    objs = render(None)
    assert named(objs, "Service", "dlo-operator")
    assert not by_kind(objs, "ServiceMonitor")
    on = {"serviceMonitor": {"enabled": True}}
    assert [m["metadata"]["name"] for m in by_kind(render(on), "ServiceMonitor")] == ["dlo-agent", "dlo-operator"]
    only_operator = render({**on, "agent": {"enabled": False}})
    assert [m["metadata"]["name"] for m in by_kind(only_operator, "ServiceMonitor")] == ["dlo-operator"]
    no_operator = render({**on, "operator": {"enabled": False}})
    assert [m["metadata"]["name"] for m in by_kind(no_operator, "ServiceMonitor")] == ["dlo-agent"]
    assert not [s for s in by_kind(no_operator, "Service") if s["metadata"]["name"] == "dlo-operator"]


def test_render_and_the_chart_agree_on_the_default_engine_image(tmp_path):
    """A spec without engine.image runs the same image under `dlo operator render` (no env: the
    built-in default) as under the chart's operator (DLO_DEFAULT_ENGINE_IMAGE from engine.image)."""
    import tomllib

    from dlo.operator.models import DEFAULT_IMAGE, DEFAULT_IMAGE_ENV

    chart_default = operator_env(render(None))[DEFAULT_IMAGE_ENV]
    chart_yaml = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert chart_default == DEFAULT_IMAGE == f"ghcr.io/dlo-dev/dlo:{chart_yaml['appVersion']}"
    assert chart_yaml["appVersion"] == project  # one release number for the package, image and chart

    spec = tmp_path / "no-image.yaml"
    spec.write_text(yaml.safe_dump({
        "apiVersion": "dlo.dev/v1alpha1", "kind": "DLODeployment",
        "metadata": {"name": "wan", "namespace": "serving"},
        "spec": {"model": {"path": "/models/wan"}, "mode": "allgather"},
    }))

    def rendered_image(env: dict[str, str]) -> str:
        proc = subprocess.run([sys.executable, "-m", "dlo.cli.main", "operator", "render", str(spec)],
                              cwd=ROOT, capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr
        (sts,) = [d for d in yaml.safe_load_all(proc.stdout) if d["kind"] == "StatefulSet"]
        return sts["spec"]["template"]["spec"]["containers"][0]["image"]

    env = {k: v for k, v in os.environ.items() if k != DEFAULT_IMAGE_ENV}
    assert rendered_image(env) == chart_default
    # and the chart's override reaches a rendered spec the same way it reaches the operator
    custom = operator_env(render({"engine": {"image": {"repository": "registry.example.com/dlo", "tag": "1.2.3"}}}))
    assert rendered_image({**env, DEFAULT_IMAGE_ENV: custom[DEFAULT_IMAGE_ENV]}) == "registry.example.com/dlo:1.2.3"


def test_monitoring_switches_are_on_where_the_crds_are_installed():
    """serviceMonitor and prometheusRule default to auto: made where the monitoring.coreos.com CRDs
    are installed (.Capabilities), never without them; true and false force. The Helm SDK renders
    offline (no monitoring CRDs), so the helper is also rendered with both answers."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert (values["serviceMonitor"]["enabled"], values["prometheusRule"]["enabled"]) == ("auto", "auto")
    assert values["podMonitor"]["enabled"] is False  # each DLODeployment's own monitor is on instead
    offline = render(None)
    assert not [o for o in offline if o["kind"] in MONITORING_KINDS]
    forced = render({"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}})
    assert {o["kind"] for o in forced if o["kind"] in MONITORING_KINDS} == {"ServiceMonitor", "PrometheusRule"}
    assert "No ServiceMonitor was created" in notes(None) and "No ServiceMonitor" not in notes(
        {"serviceMonitor": {"enabled": True}})
    probe = ('{{- range $e := list true false "auto" }}{{ range $h := list true false }}'
             '{{ $e }}/{{ $h }}={{ include "dlo.monitoringOn" (dict "enabled" $e "has" $h) }};{{ end }}{{ end }}')
    answers = _render_probe(probe)
    assert answers == {"true/true": "true", "true/false": "true", "false/true": "", "false/false": "",
                       "auto/true": "true", "auto/false": ""}


def _render_probe(template: str) -> dict[str, str]:
    """A copy of the chart with one more template, rendered: `key=value;` pairs."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        copy = Path(d) / "dlo"
        shutil.copytree(CHART, copy)
        (copy / "templates" / "probe.txt").write_text(template)
        out = helm.Chart.load(str(copy)).render(None, name="dlo", namespace="dlo-system")
    text = next(v for k, v in out.items() if k.endswith("probe.txt"))
    return dict(pair.split("=", 1) for pair in text.strip().rstrip(";").split(";"))


def test_operator_alerts_have_unit_tests_runbooks_and_series_the_operator_serves():
    """The alerts on the operator's own metrics (rules/operator/): a promtool unit test each, a runbook
    section each, and every dlo_operator_* selector names a series and labels a real operator serves
    (the chart's ServiceMonitor adds job; honorLabels keeps the series' namespace)."""
    import re

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from dlo.operator import metrics

    alerts = [r for f in (CHART / "rules" / "operator").glob("*.yaml") for g in yaml.safe_load(f.read_text())["groups"]
              for r in g["rules"]]
    assert {a["alert"] for a in alerts} == {"DLODeploymentDegraded", "DLOModelFetchFailed"}
    tested = {t["alertname"] for f in (CHART / "rules" / "operator" / "tests").glob("*.yaml")
              for case in yaml.safe_load(f.read_text())["tests"] for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert tested == {a["alert"] for a in alerts}
    headings = set(re.findall(r"^## (\w+)$", (ROOT / "docs" / "runbooks.md").read_text(), re.M))
    for a in alerts:
        assert a["annotations"]["runbook_url"].endswith("#" + a["alert"].lower()) and a["alert"] in headings
    metrics.CONDITIONS.observe("serving", "probe", [{"type": "Degraded", "status": "True", "reason": "NodeLost"}])
    try:
        served = {s.name: set(s.labels) for fam in text_string_to_metric_families(generate_latest(metrics.REGISTRY)
                                                                                  .decode()) for s in fam.samples}
    finally:
        metrics.CONDITIONS.forget("serving", "probe")
    for a in alerts:
        for name, matchers in re.findall(r"\b(dlo_operator_\w+)\{([^}]*)\}", a["expr"]):
            labels = set(re.findall(r"(\w+)=", matchers)) - {"job"}
            assert name in served and labels <= served[name], (a["alert"], name, labels)
    sm = named(render({"serviceMonitor": {"enabled": True}}), "ServiceMonitor", "dlo-operator")
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True
