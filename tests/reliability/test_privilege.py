"""Least privilege, on what is really deployed: the chart rendered by Helm's own engine and the
operator's builders' output.

- Operator and engine containers: non-root, read-only root filesystem, no privilege escalation,
  every capability dropped (the engine adds IPC_LOCK only when `pinMemoryLock` asks for it).
- The agent's extra rights (hostPID, read-only host mounts, root with SYS_PTRACE and
  DAC_READ_SEARCH) are exactly those charts/dlo/README.md lists and justifies.
- RBAC: the rendered ClusterRoles equal the minimal sets below; every API call the operator makes
  through a whole lifecycle on the API emulator is allowed by its role, and every permission is
  either used in that lifecycle or one of the few documented exceptions.
- The API key: a Secret reference (`DLO_API_KEY`, or `VLLM_API_KEY` for vllm-omni, via
  `secretKeyRef`) and never its value, neither
  in rendered manifests nor in anything the operator writes; the operator never reads Secrets.
"""

from __future__ import annotations

import json
import re
import secrets
import sys
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from cluster import dlodeployment, live_objects, running_cluster  # noqa: E402
from dlo.operator import builders  # noqa: E402
from dlo.operator.builders import Owner  # noqa: E402
from dlo.operator.kube import USER_AGENT  # noqa: E402
from dlo.plan.facts import MODES  # noqa: E402
from dlo.operator.models import SpecError, parse_spec  # noqa: E402
from dlo.operator.security_config import NetworkPolicySettings  # noqa: E402
from test_chart import CHART, VALUES, by_kind, render  # noqa: E402
from test_cli import dlo  # noqa: E402
from test_handlers import NS, SPEC, add_gpu_nodes, condition, gpu_node_profile, status_of  # noqa: E402

README = (CHART / "README.md").read_text()
OWNER = Owner("wan", "serving")

# ---- the minimal RBAC, as (apiGroup, resource, verb) ---------------------------------------

CLUSTER_RULES = {
    # node profiles through a watch; the model.dlo.dev/<key> label of a node holding a fetched model
    ("", "nodes", "list"), ("", "nodes", "watch"), ("", "nodes", "patch"),
    # kopf observes resources, and namespaces when watchNamespaces holds a pattern.
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
    ("", "namespaces", "list"), ("", "namespaces", "watch"),
}
NAMESPACED_RULES = {
    # kopf: list + watch the resource; patch: its status, and the finalizer of earlier versions removed.
    ("dlo.dev", "dlodeployments", "list"), ("dlo.dev", "dlodeployments", "watch"),
    ("dlo.dev", "dlodeployments", "patch"), ("dlo.dev", "dlodeployments/status", "patch"),
    # blockOwnerDeletion on the children's owner references (an admission check, no API call).
    ("dlo.dev", "dlodeployments/finalizers", "update"),
    # The children, server-side applied (patch; create for the first apply); the StatefulSets watched
    # (read where the watch has not seen one yet).
    ("apps", "statefulsets", "get"), ("apps", "statefulsets", "list"), ("apps", "statefulsets", "watch"),
    *((g, r, v) for g, r in (("apps", "statefulsets"), ("", "services"), ("policy", "poddisruptionbudgets"),
                             ("monitoring.coreos.com", "podmonitors"), ("monitoring.coreos.com", "servicemonitors"),
                             ("keda.sh", "scaledobjects"), ("autoscaling", "horizontalpodautoscalers"))
      for v in ("create", "patch")),
    ("keda.sh", "scaledobjects", "delete"), ("autoscaling", "horizontalpodautoscalers", "delete"),
    # networkPolicy.enabled: the engine pods' NetworkPolicy (server-side applied; deleted once turned off)
    ("networking.k8s.io", "networkpolicies", "create"), ("networking.k8s.io", "networkpolicies", "patch"),
    ("networking.k8s.io", "networkpolicies", "delete"),
    # Engine and fetch pods through a watch; Recreate rollouts delete pods; a fetch's progress is its log.
    ("", "pods", "list"), ("", "pods", "watch"), ("", "pods", "delete"), ("", "pods/log", "get"),
    # spec.model.uri: fetch Jobs
    ("batch", "jobs", "list"), ("batch", "jobs", "watch"), ("batch", "jobs", "create"), ("batch", "jobs", "delete"),
    ("", "events", "create"), ("", "events", "list"),
}
OPERATOR_RULES = CLUSTER_RULES | NAMESPACED_RULES
# Leader election, in the release namespace only (Role <release>-operator-lease).
LEASE_RULES = {("coordination.k8s.io", "leases", v) for v in ("get", "create", "patch")}
# Allowed but not called in the emulated lifecycle, and why.
UNUSED_BY_DESIGN = {
    ("dlo.dev", "dlodeployments/finalizers", "update"): "authorises blockOwnerDeletion; never called",
    ("dlo.dev", "dlodeployments", "patch"): "removes the finalizer an earlier version's kopf daemon added",
    ("", "namespaces", "list"): "kopf, only for a namespace pattern in watchNamespaces",
    ("", "namespaces", "watch"): "kopf, only for a namespace pattern in watchNamespaces",
    ("monitoring.coreos.com", "servicemonitors", "create"): "monitoring.kind ServiceMonitor",
    ("monitoring.coreos.com", "servicemonitors", "patch"): "monitoring.kind ServiceMonitor",
    ("keda.sh", "scaledobjects", "create"): "autoscaling with KEDA installed",
    ("keda.sh", "scaledobjects", "patch"): "autoscaling with KEDA installed",
    ("keda.sh", "scaledobjects", "delete"): "autoscaling leaving KEDA",
    ("networking.k8s.io", "networkpolicies", "delete"): "an operator run without networkPolicy after one with it",
}
# Used when the emulated lifecycle happens to catch it (a pod scheduled, its containers not started yet).
MAYBE_UNUSED = {("", "events", "list"): "a scheduled pod whose containers have not started (FailedMount)",
                ("apps", "statefulsets", "get"): "model.uri before the watch has seen the StatefulSet",
                ("", "pods/log", "get"): "a running fetch pod's progress (the emulated kubelet runs fetch pods "
                                          "briefly: a loaded machine's reconcile can catch one running)"}
AGENT_RULES = {("", "pods", "list"), ("", "pods", "watch"), ("", "nodes", "patch")}


def rules_of(role: dict) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def allowed(rules: set[tuple[str, str, str]], group: str, resource: str, verb: str) -> bool:
    return (group, resource, verb) in rules


@pytest.mark.parametrize("case", VALUES)
def test_rendered_roles_equal_the_minimal_sets(case):
    objs = render(VALUES[case])
    roles = {r["metadata"]["name"]: r for r in by_kind(objs, "ClusterRole")}
    agent_on = (VALUES[case] or {}).get("agent", {}).get("enabled", True)
    assert set(roles) == {"dlo-operator", "dlo-agent"} if agent_on else {"dlo-operator"}
    watched = (VALUES[case] or {}).get("operator", {}).get("watchNamespaces") or []
    ns_roles = {r["metadata"]["namespace"]: r for r in by_kind(objs, "Role") if r["metadata"]["name"] == "dlo-operator"}
    assert set(ns_roles) == set(watched)
    (lease,) = [r for r in by_kind(objs, "Role") if r["metadata"]["name"] == "dlo-operator-lease"]
    assert lease["metadata"]["namespace"] == "dlo-system" and rules_of(lease) == LEASE_RULES
    for role in [*roles.values(), *ns_roles.values()]:
        for rule in role["rules"]:
            assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames, no nonResourceURLs
            assert "*" not in rule["apiGroups"] + rule["resources"] + rule["verbs"], rule
    if watched:  # cluster-wide only what must be; the rest per watched namespace
        assert rules_of(roles["dlo-operator"]) == CLUSTER_RULES
        assert all(rules_of(r) == NAMESPACED_RULES for r in ns_roles.values())
        for binding in by_kind(objs, "RoleBinding"):
            if binding["metadata"]["name"] == "dlo-operator-lease":
                continue
            assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "dlo-operator"}
            assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "dlo-operator", "namespace": "dlo-system"}]
    else:
        assert rules_of(roles["dlo-operator"]) == OPERATOR_RULES
    if agent_on:
        assert rules_of(roles["dlo-agent"]) == AGENT_RULES
    for binding in by_kind(objs, "ClusterRoleBinding"):
        name = binding["metadata"]["name"]
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": "dlo-system"}]


def test_readme_permission_tables_match_the_rendered_roles():
    """Every (group, resource, verbs) row of the README's permission tables is a rendered rule."""
    tables = README.split("## Permissions", 1)[1]
    operator_part, agent_part = tables.split("Agent (ClusterRole", 1)
    for part, expected in ((operator_part, OPERATOR_RULES | LEASE_RULES), (agent_part, AGENT_RULES)):
        documented = set()
        for row in re.findall(r"^\| (.+?) \| (.+?) \| (.+?) \| .+\|$", part, re.M):
            row = row[:3]
            groups, resources, verbs = (re.findall(r"`([^`]+)`|\b(core)\b", cell) for cell in row)
            if not resources:
                continue
            for g in groups:
                for r in resources:
                    for v in row[2].replace(" ", "").split(","):
                        documented.add(("" if g[1] == "core" else g[0], r[0], v))
        assert documented == expected


# ---- containers ------------------------------------------------------------------------------


def assert_locked_down(container: dict, pod: dict, *, adds: tuple[str, ...] = ()) -> None:
    sc = container.get("securityContext", {})
    pod_sc = pod.get("securityContext", {})
    name = container["name"]
    assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, name
    assert sc.get("runAsUser", pod_sc.get("runAsUser", 0)) != 0, name
    assert sc["allowPrivilegeEscalation"] is False, name
    assert sc["readOnlyRootFilesystem"] is True, name
    assert sc.get("privileged", False) is False, name
    assert sc["capabilities"]["drop"] == ["ALL"], name
    assert tuple(sc["capabilities"].get("add", ())) == adds, name
    assert (sc.get("seccompProfile") or pod_sc.get("seccompProfile")) == {"type": "RuntimeDefault"}, name
    for key in ("hostPID", "hostIPC", "hostNetwork"):
        assert not pod.get(key), (name, key)
    assert not [v for v in pod.get("volumes", []) if "hostPath" in v and v["name"] != "model"], name


@pytest.mark.parametrize("case", VALUES)
def test_operator_container_is_non_root_read_only_without_capabilities(case):
    (deploy,) = by_kind(render(VALUES[case]), "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert_locked_down(container, pod)


ENGINE_SPECS = {
    "default": {"model": {"path": "/models/wan"}},
    "pinning": {"model": {"path": "/models/wan"}, "engine": {"pinMemoryLock": True}},
    "vllm-omni-claim": {"model": {"claimName": "models", "subPath": "wan"}, "engine": {"kind": "vllm-omni"}},
    "no-warmer-cpu": {"model": {"path": "/models/wan"}, "warmer": {"enabled": False}, "engine": {"device": "cpu"}},
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ENGINE_SPECS)
def test_engine_and_warmer_containers_are_locked_down_ipc_lock_only_when_asked(case, mode):
    spec = parse_spec(ENGINE_SPECS[case])
    pod = builders.build_statefulset(OWNER, spec, mode)["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False  # the engine never talks to the API
    (engine,) = pod["containers"]
    assert_locked_down(engine, pod, adds=("IPC_LOCK",) if spec.engine.pin_memory_lock else ())
    for init in pod.get("initContainers", []):
        assert_locked_down(init, pod)  # the warmer never pins
    writable = {m["mountPath"] for m in engine["volumeMounts"] if not m.get("readOnly")}
    # emptyDirs only (finished videos kept for their TTL included); the model is mounted read-only
    videos = {"/var/lib/dlo/videos"} if spec.engine.kind == "dlo" else set()  # vllm-omni keeps none
    assert writable == {"/dev/shm", "/tmp"} | videos
    volumes = {v["name"]: v for v in pod["volumes"]}
    for m in engine["volumeMounts"]:
        if not m.get("readOnly"):
            assert "emptyDir" in volumes[m["name"]], m


def test_agent_extra_rights_are_exactly_those_the_readme_lists_and_justifies():
    (ds,) = by_kind(render(VALUES["all-on"]), "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    sc = agent["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc.get("privileged", False) is False and sc["capabilities"]["drop"] == ["ALL"]
    assert not pod.get("hostNetwork") and not pod.get("hostIPC")
    section = README.split("## Permissions", 1)[1]
    # Each extra right appears in the README with a reason in the same sentence.
    extras = [f"`{cap}` (" for cap in sc["capabilities"]["add"]] + ["`hostPID: true` ("]
    assert pod["hostPID"] is True
    assert [e for e in extras if e not in section] == []
    assert sorted(sc["capabilities"]["add"]) == ["DAC_READ_SEARCH", "SYS_PTRACE"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m for m in agent["volumeMounts"]}
    for name in host_paths:
        assert mounts[name]["readOnly"] is True, name
    for path in ("/proc", "/sys/fs/cgroup", "/sys"):
        assert path in host_paths.values() and f"`{path}`" in section
    assert "**read-only**" in section and "runs as root" in section
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert "`NVIDIA_VISIBLE_DEVICES=all`" in section and "`NVIDIA_DRIVER_CAPABILITIES=utility`" in section


# Volume types the `restricted` Pod Security Standard allows.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def restricted_violations(pod: dict) -> list[str]:
    """What keeps a pod spec from the `restricted` Pod Security Standard (the checks that apply)."""
    out = [f"volume {v['name']}" for v in pod.get("volumes", []) if not set(v) - {"name"} <= RESTRICTED_VOLUMES]
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc = c.get("securityContext", {})
        added = set(sc.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}
        out += [f"{c['name']}: capability {a}" for a in sorted(added)]
        if sc.get("capabilities", {}).get("drop") != ["ALL"]:
            out.append(f"{c['name']}: capabilities not dropped")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{c['name']}: privilege escalation")
        if not sc.get("runAsNonRoot", pod.get("securityContext", {}).get("runAsNonRoot")):
            out.append(f"{c['name']}: may run as root")
    if pod.get("securityContext", {}).get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
        out.append("seccomp")
    return out


@pytest.mark.parametrize("case, expected", [
    ("vllm-omni-claim", []),
    ("default", ["volume model"]),
    ("pinning", ["volume model", "engine: capability IPC_LOCK"]),
])
def test_engine_pod_security_level_is_as_the_readme_says(case, expected):
    pod = builders.build_statefulset(OWNER, parse_spec(ENGINE_SPECS[case]), "allgather")["spec"]["template"]["spec"]
    assert restricted_violations(pod) == expected
    section = README.split("## Permissions", 1)[1]
    assert "meet the `restricted` Pod Security Standard" in section
    assert "`model.path` (a hostPath" in section and "`engine.pinMemoryLock` (`IPC_LOCK`)" in section


@pytest.mark.parametrize("case", VALUES)
def test_operator_pod_meets_the_restricted_pod_security_standard(case):
    (deploy,) = by_kind(render(VALUES[case]), "Deployment")
    assert restricted_violations(deploy["spec"]["template"]["spec"]) == []


# ---- the API key -----------------------------------------------------------------------------

KEY = "sk-" + secrets.token_hex(24)  # what the Secret holds; nothing we render may contain it


@pytest.mark.parametrize("case", ENGINE_SPECS)
def test_builders_reference_the_api_key_secret_and_never_carry_a_value(case):
    raw = {**ENGINE_SPECS[case], "engine": {**ENGINE_SPECS[case].get("engine", {}),
                                            "apiKeySecret": {"name": "wan-api", "key": "token"}}}
    spec = parse_spec(raw)
    objs = builders.build_all(OWNER, spec, "allgather", monitor_crd_exists=True)
    (sts,) = [o for o in objs if o["kind"] == "StatefulSet"]
    (engine,) = sts["spec"]["template"]["spec"]["containers"]
    # vLLM reads its key from VLLM_API_KEY; dlo serve from DLO_API_KEY
    name = "VLLM_API_KEY" if spec.engine.kind == "vllm-omni" else "DLO_API_KEY"
    keyed = [e for e in engine["env"] if e["name"].endswith("API_KEY")]
    assert keyed == [{"name": name, "valueFrom": {"secretKeyRef": {"name": "wan-api", "key": "token"}}}]
    assert not any("api-key" in a or "api_key" in a for a in engine["command"] + engine.get("args", []))
    assert not any(o["kind"] == "Secret" for o in objs)


@pytest.mark.parametrize("item", [{"name": "DLO_API_KEY", "value": KEY},
                                  {"name": "DLO_API_KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
                         ids=["literal", "secret-ref"])
def test_api_key_in_engine_env_is_refused_in_favour_of_api_key_secret(item):
    with pytest.raises(SpecError, match=r"spec\.engine: .*must not set DLO_API_KEY.*engine\.apiKeySecret") as refused:
        parse_spec({"model": {"path": "/m"}, "engine": {"env": [{"name": "OTHER", "value": "x"}, item]}})
    assert KEY not in str(refused.value)


def test_chart_renders_no_secret_and_no_key():
    for case, values in VALUES.items():
        objs = render(values)
        assert not by_kind(objs, "Secret"), case
        for obj in objs:
            for c in obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                assert not [e for e in c.get("env", []) if "KEY" in e["name"] or "TOKEN" in e["name"]], (case, c["name"])


def verb_of(request: Any) -> str:
    if request.action == kmock.action.UPDATE:
        return "update" if request.method.value == "PUT" else "patch"
    return {"LIST": "list", "WATCH": "watch", "FETCH": "get", "CREATE": "create", "DELETE": "delete"}[request.action.value]


async def test_operator_lifecycle_stays_inside_its_role_and_never_sees_the_api_key():
    """Create (monitoring on, API key), roll the mode, scale, break and fix the spec, delete:
    every call of the operator (kopf's, its own client's and its leader election's) is allowed by
    the rendered roles."""
    network_policy = NetworkPolicySettings(None, ("monitoring",), "dlo-system")  # the chart's default
    async with running_cluster(with_operator=False, network_policy=network_policy) as cluster:
        cluster.start_operator("a")  # with leader election, as the chart runs it
        cluster.emulator.resources["monitoring.coreos.com/v1/podmonitors"] = kmock.ResourceInfo(
            kind="PodMonitor", singular="podmonitor", namespaced=True,
            verbs={"get", "list", "watch", "create", "patch", "delete"})
        await add_gpu_nodes(cluster, count=2)
        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "wan-api", "namespace": NS},
                  "stringData": {"token": KEY}}
        await cluster.create(secret)
        spec = {**SPEC, "monitoring": {"enabled": True}, "engine": {"apiKeySecret": {"name": "wan-api", "key": "token"}},
                "rollout": {"type": "Recreate"}}
        await cluster.create(dlodeployment("wan", NS, spec))
        await cluster.wait(lambda: cluster.get("PodMonitor", NS, "wan"), what="PodMonitor")
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
        await cluster.patch_dlod(NS, "wan", {"spec": {"mode": "rank-local"}})
        await cluster.wait(lambda: cluster.events("PodRecreated"), what="Recreate rollout")
        await cluster.patch_dlod(NS, "wan", {"spec": {"replicas": 1}})
        await cluster.wait(lambda: status_of(cluster).get("replicas") == 1, what="scaled")
        # Changes that patch every other child: the Services' port, the PDB, the monitor's labels.
        await cluster.patch_dlod(NS, "wan", {"spec": {"service": {"port": 8080}, "monitoring": {"labels": {"r": "p"}},
                                                     "rollout": {"type": "RollingUpdate", "maxUnavailable": 2}}})
        await cluster.wait(lambda: cluster.get("PodDisruptionBudget", NS, "wan")["spec"]["maxUnavailable"] == 2
                           and cluster.get("PodMonitor", NS, "wan")["metadata"]["labels"].get("r") == "p"
                           and cluster.get("Service", NS, "wan")["spec"]["ports"][0]["port"] == 8080, what="patched")
        await cluster.patch_dlod(NS, "wan", {"spec": {"devicesPerNode": 0}})
        await cluster.wait(lambda: (condition(cluster, "Degraded") or {}).get("status") == "True", what="Degraded")
        await cluster.patch_dlod(NS, "wan", {"spec": {"devicesPerNode": 8}})
        await cluster.wait(lambda: (condition(cluster, "Degraded") or {}).get("status") == "False", what="fixed")
        # autoscaling on (no KEDA here: an HPA), then off (the HPA is deleted)
        await cluster.patch_dlod(NS, "wan", {"spec": {"autoscaling": {"enabled": True}}})
        await cluster.wait(lambda: cluster.get("HorizontalPodAutoscaler", NS, "wan"), what="HPA")
        await cluster.patch_dlod(NS, "wan", {"spec": {"autoscaling": {"enabled": False}}})
        await cluster.wait(lambda: not cluster.get("HorizontalPodAutoscaler", NS, "wan"), what="HPA deleted")
        # a fetched model: a node whose profile lists it is labelled, the other gets a fetch Job; a new
        # uri makes that Job stale (deleted)
        uri = "s3://models/flux"
        key = parse_spec({"model": {"uri": uri}}).model.cache_key
        listed = json.loads(gpu_node_profile("node-0", "h200-node.json")["dlo.dev/node-profile"])
        listed["models"] = {key: {"bytes": 10, "largest_block_bytes": 1, "blocks": 1}}
        await cluster.call(cluster.kube.patch, "v1", "Node", None, "node-0",
                           {"metadata": {"annotations": {"dlo.dev/node-profile": json.dumps(listed)}}})
        await cluster.create(dlodeployment("flux", NS, {**SPEC, "model": {"uri": uri}, "mode": "allgather"}))
        await cluster.wait(lambda: cluster.objects("Job", NS), what="a fetch Job")
        # a new uri: fetched beside the one the pods run; a third one makes the second's Jobs stale
        v2 = parse_spec({"model": {"uri": "s3://models/flux-v2"}}).model.cache_key

        def jobs_for(k: str) -> list:
            return [j for j in cluster.objects("Job", NS) if j["metadata"]["annotations"]["dlo.dev/model-key"] == k]

        await cluster.patch_dlod(NS, "flux", {"spec": {"model": {"uri": "s3://models/flux-v2"}}})
        await cluster.wait(lambda: jobs_for(v2), what="fetch Jobs of the new uri")
        await cluster.patch_dlod(NS, "flux", {"spec": {"model": {"uri": "s3://models/flux-v3"}}})
        await cluster.wait(lambda: not jobs_for(v2), what="the stale fetch Jobs deleted")
        assert await cluster.delete_dlod(NS, "flux")
        written = [o for o in live_objects(cluster.emulator) if o.get("kind") != "Secret"] + cluster.events_all()
        assert await cluster.delete_dlod(NS, "wan")
        await cluster.wait(lambda: not cluster.objects("StatefulSet", NS), what="children collected")

    operator_calls = [
        r for r in cluster.emulator
        if r.resource is not None and r.resource.plural and r.headers.get("User-Agent", "").startswith((USER_AGENT, "kopf/"))
    ]
    used = {(r.resource.group or "", r.resource.plural + (f"/{r.subresource}" if r.subresource else ""), verb_of(r))
            for r in operator_calls}
    # A server-side apply of an object that does not exist yet creates it: the API server asks for
    # `create` as well as `patch` (the first apply of each object in the lifecycle made it).
    applied: set[str] = set()
    for r in operator_calls:
        if r.headers.get("Content-Type", "").startswith("application/apply-patch") and str(r.url.path) not in applied:
            applied.add(str(r.url.path))
            used.add((r.resource.group or "", r.resource.plural, "create"))
    assert used - OPERATOR_RULES - LEASE_RULES == set()  # everything it did, its roles allow
    assert LEASE_RULES <= used  # created, read, renewed
    assert set(UNUSED_BY_DESIGN) <= OPERATOR_RULES - used <= set(UNUSED_BY_DESIGN) | set(MAYBE_UNUSED)  # accounted for
    assert not [r for r in operator_calls if r.resource.plural == "secrets"]
    print(f"FIGURE rbac_lifecycle operator_calls={len(operator_calls)} permissions_used={len(used)}"
          f" granted={len(OPERATOR_RULES)} unused_by_design={len(UNUSED_BY_DESIGN)}")
    assert KEY not in json.dumps(written)
    assert "wan-api" in json.dumps(cluster.get("StatefulSet", NS, "wan") or written)  # the reference is there


@pytest.mark.parametrize("affinity", ["required", "preferred"])
def test_fetch_containers_are_non_root_without_capabilities_and_write_only_the_cache(affinity):
    """`dlo fetch` writes the node's cache folder as uid 10001; the one root container the operator
    makes is the cache-owner step before it (CAP_CHOWN alone, the cache mounted, no credentials);
    nothing else is granted, and the credentials are references."""
    from dlo.operator.fetch_builder import build_fetch_job
    from dlo.operator.names import BuildContext

    spec = parse_spec({"model": {"uri": "s3://models/wan", "secretRef": {"name": "store"}},
                       "placement": {"modelAffinity": affinity}})
    job = build_fetch_job(OWNER, spec, "node-1", [], BuildContext(), None, "dlo:1")
    pods = [job["spec"]["template"]["spec"]]
    pods.append(builders.build_statefulset(OWNER, spec, "allgather")["spec"]["template"]["spec"])
    for pod in pods:
        fetchers = [c for c in pod.get("initContainers", []) + pod["containers"] if c["name"] == "fetch"]
        if affinity == "required" and pod is pods[1]:
            assert fetchers == []  # the pods go where the model is: no fetch in them
            continue
        (fetch,) = fetchers
        sc = fetch["securityContext"]
        assert sc == {"runAsUser": 10001, "runAsGroup": 10001, "runAsNonRoot": True, "allowPrivilegeEscalation": False,
                      "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
        (owner,) = [c for c in pod.get("initContainers", []) if c["name"] == "cache-owner"]
        assert owner["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
        assert [m["name"] for m in owner["volumeMounts"]] == ["model-cache"] and "env" not in owner
        writable = {m["name"] for m in fetch["volumeMounts"] if not m.get("readOnly")}
        assert writable == {"model-cache", "tmp"}
        cache = next(v for v in pod["volumes"] if v["name"] == "model-cache")
        assert cache["hostPath"]["type"] == "DirectoryOrCreate"
        assert all("secretKeyRef" in e["valueFrom"] for e in fetch["env"] if e["name"].startswith("AWS_"))
        assert pod["automountServiceAccountToken"] is False


def test_dlo_operator_render_references_the_key_and_leaves_the_secret_unread(tmp_path):
    """`dlo operator render` on a file that also holds the Secret: the output references it only."""
    res = {"apiVersion": "dlo.dev/v1alpha1", "kind": "DLODeployment", "metadata": {"name": "wan", "namespace": NS},
           "spec": {"model": {"path": "/models/wan"}, "mode": "allgather",
                    "engine": {"apiKeySecret": {"name": "wan-api", "key": "token"}}}}
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "wan-api", "namespace": NS},
              "stringData": {"token": KEY}}
    path = tmp_path / "res.yaml"
    path.write_text(yaml.safe_dump_all([secret, res]))
    proc = dlo("operator", "render", str(path))
    assert proc.returncode == 0, proc.stderr
    assert KEY not in proc.stdout + proc.stderr
    assert "secretKeyRef" in proc.stdout and "DLO_API_KEY" in proc.stdout
    assert not [d for d in yaml.safe_load_all(proc.stdout) if d and d["kind"] == "Secret"]
