"""operator/builders.py: spec (+ resolved mode) -> manifests, checked against golden files and the
upstream Kubernetes schemas (strict: unknown fields are errors)."""

import argparse
import os
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from dlo.operator import builders
from dlo.operator.builders import Owner
from dlo.operator.models import parse_spec

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
K8S_VERSION = "1.37.0"
OWNER = Owner("wan", "serving")


def example_spec() -> dict:
    docs = yaml.safe_load_all((ROOT / "examples" / "dlodeployment.yaml").read_text())
    return next(d for d in docs if d and d["kind"] == "DLODeployment")["spec"]


CASES = {
    "example-allgather": (example_spec(), "allgather"),
    "claim-rolling-vllm-omni-rank-local": (
        {
            "model": {"claimName": "models", "subPath": "wan2.1-14b"},
            "replicas": 3,
            "devicesPerNode": 4,
            "acceleratorResource": "huawei.com/Ascend910",
            "engine": {
                "kind": "vllm-omni",
                "image": "ghcr.io/dlo-dev/dlo-vllm-omni:0.1.0",
                "device": "npu",
                "env": [{"name": "ASCEND_RT_VISIBLE_DEVICES", "value": "0,1,2,3"}],
                "pinMemoryLock": True,
                "shmSize": "16Gi",
            },
            "warmer": {"enabled": True, "threshold": 0.9, "image": "ghcr.io/dlo-dev/dlo-slim:0.1.0"},
            "placement": {
                "nodeSelector": {"accelerator": "ascend-910b"},
                "tolerations": [{"key": "huawei.com/Ascend910", "operator": "Exists", "effect": "NoSchedule"}],
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                            ]
                        }
                    }
                },
                "priorityClassName": "inference",
            },
            "rollout": {"type": "RollingUpdate", "maxUnavailable": 1},
            "service": {"type": "LoadBalancer", "port": 8080},
            "monitoring": {"enabled": True, "kind": "ServiceMonitor", "labels": {"release": "prom"}},
        },
        "rank-local",
    ),
    "cpu-no-warmer-podmonitor": (
        {
            "model": {"path": "/models/tiny"},
            "engine": {"device": "cpu", "args": ["--wave-window-ms", "10"]},
            "warmer": {"enabled": False},
            "monitoring": {"enabled": True},
        },
        "resident",
    ),
    "pod-customised-lora-path": (
        {
            "model": {"uri": "s3://models/wan2.1-14b"},
            "pod": {
                "serviceAccountName": "wan-engine",
                "imagePullSecrets": [{"name": "registry"}],
                "runtimeClassName": "nvidia",
                "labels": {"kueue.x-k8s.io/queue-name": "gpu"},
                "annotations": {"sidecar.istio.io/inject": "false"},
                "volumes": [{"name": "ca", "configMap": {"name": "corporate-ca"}}],
                "volumeMounts": [{"name": "ca", "mountPath": "/etc/ssl/certs/corporate", "readOnly": True}],
            },
            "lora": {"path": "/var/lib/lora/wan"},
        },
        "allgather",
    ),
}


def build(case: str) -> list[dict]:
    spec, mode = CASES[case]
    return builders.build_all(OWNER, parse_spec(spec), mode, monitor_crd_exists=True)


@pytest.mark.parametrize("case", CASES)
def test_objects_match_golden_file(case):
    text = yaml.safe_dump_all(build(case), sort_keys=False, width=100)
    path = GOLDEN / f"{case}.yaml"
    if os.environ.get("DLO_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{path.name} differs: review, then DLO_UPDATE_GOLDEN=1 to rewrite"


@pytest.mark.parametrize("case", CASES)
def test_builtin_objects_are_strictly_valid_kubernetes(case):
    for obj in build(case):
        if obj["apiVersion"].startswith("monitoring.coreos.com"):
            continue  # not a built-in kind; checked below
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_monitor_only_when_enabled_and_its_crd_exists():
    spec = parse_spec(CASES["cpu-no-warmer-podmonitor"][0])
    kinds = [o["kind"] for o in builders.build_all(OWNER, spec, "resident", monitor_crd_exists=True)]
    assert kinds == ["Service", "Service", "PodDisruptionBudget", "StatefulSet", "PodMonitor"]
    kinds = [o["kind"] for o in builders.build_all(OWNER, spec, "resident", monitor_crd_exists=False)]
    assert "PodMonitor" not in kinds
    spec = parse_spec(example_spec())  # on by default where the CRD is installed
    assert "PodMonitor" in [o["kind"] for o in builders.build_all(OWNER, spec, "allgather", True)]
    off = parse_spec({**example_spec(), "monitoring": {"enabled": False}})
    assert "PodMonitor" not in [o["kind"] for o in builders.build_all(OWNER, off, "allgather", True)]


def test_service_monitor_selects_only_the_client_service():
    objs = build("claim-rolling-vllm-omni-rank-local")
    monitor = objs[-1]
    client = objs[1]
    assert monitor["kind"] == "ServiceMonitor" and monitor["metadata"]["labels"]["release"] == "prom"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert all(client["metadata"]["labels"][k] == v for k, v in selector.items())
    assert objs[0]["metadata"]["labels"]["dlo.dev/service"] != selector["dlo.dev/service"]


@pytest.mark.parametrize("case", ["cpu-no-warmer-podmonitor", "claim-rolling-vllm-omni-rank-local"])
def test_own_monitor_relabels_targets_as_the_charts_podmonitor(case):
    """Dashboards and alerts select job, deployment and node: a DLODeployment's own PodMonitor or
    ServiceMonitor sets exactly the chart PodMonitor's relabelings (the chart's own, without the
    user's podMonitor.relabelings), so the two cannot drift."""
    import helm_python as helm

    rendered = helm.Chart.load(str(ROOT / "charts" / "dlo")).render(
        {"podMonitor": {"enabled": True}}, name="dlo", namespace="dlo-system")
    (chart_pm,) = [d for path, text in rendered.items() if not path.endswith("NOTES.txt")
                   for d in yaml.safe_load_all(text) if d and d.get("kind") == "PodMonitor"]
    (chart_endpoint,) = chart_pm["spec"]["podMetricsEndpoints"]
    monitor = build(case)[-1]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints" if monitor["kind"] == "PodMonitor" else "endpoints"]
    assert endpoint["relabelings"] == chart_endpoint["relabelings"]
    targets = {r["targetLabel"]: r for r in endpoint["relabelings"]}
    assert targets["deployment"]["sourceLabels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_instance"]
    assert targets["node"]["sourceLabels"] == ["__meta_kubernetes_pod_node_name"]
    assert targets["job"]["replacement"] == "dlo-engine"
    # the pod label the deployment label comes from is the DLODeployment's name on the engine pods
    sts = build(case)[3]
    assert sts["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/instance"] == OWNER.name


@pytest.mark.parametrize(
    "rollout, expected",
    [
        ({"type": "Recreate"}, {"type": "OnDelete"}),
        ({"type": "RollingUpdate"}, {"type": "RollingUpdate", "rollingUpdate": {"partition": 0, "maxUnavailable": 1}}),
        (
            {"type": "RollingUpdate", "maxUnavailable": "25%"},
            {"type": "RollingUpdate", "rollingUpdate": {"partition": 0, "maxUnavailable": "25%"}},
        ),
    ],
)
def test_update_strategy_emits_only_valid_statefulset_values_and_never_surges(rollout, expected):
    spec = parse_spec({"model": {"path": "/m"}, "rollout": rollout})
    strategy = builders.build_statefulset(OWNER, spec, "allgather")["spec"]["updateStrategy"]
    assert strategy == expected
    assert strategy["type"] in builders.STATEFULSET_STRATEGIES
    assert "maxSurge" not in strategy.get("rollingUpdate", {})


def test_pod_settings_reach_the_engine_pods_and_the_fetch_jobs_their_identity():
    """spec.pod: identity, pull Secrets, runtime, labels, annotations and extra volumes on the engine
    pods (the operator's own labels and annotations kept); a fetch Job runs the same image with the
    same identity and pull Secrets, and nothing else of it (a sidecar annotation would keep a Job's
    pod from ever completing)."""
    from dlo.operator.fetch_builder import build_fetch_job

    spec = parse_spec(CASES["pod-customised-lora-path"][0])
    template = build("pod-customised-lora-path")[3]["spec"]["template"]
    pod = template["spec"]
    assert (pod["serviceAccountName"], pod["imagePullSecrets"], pod["runtimeClassName"]) == (
        "wan-engine", [{"name": "registry"}], "nvidia")
    assert pod["automountServiceAccountToken"] is False
    assert template["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu"
    assert template["metadata"]["labels"]["app.kubernetes.io/instance"] == "wan"
    assert template["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
    assert builders.TEMPLATE_HASH in template["metadata"]["annotations"]
    (engine,) = pod["containers"]
    assert engine["command"][-2:] == ["--lora-dir", "/lora"]
    assert {"name": "lora", "mountPath": "/lora", "readOnly": True} in engine["volumeMounts"]
    assert {"name": "lora", "hostPath": {"path": "/var/lib/lora/wan", "type": "Directory"}} in pod["volumes"]
    assert engine["volumeMounts"][-1]["name"] == "ca" and pod["volumes"][-1]["name"] == "ca"
    job = build_fetch_job(OWNER, spec, "node-0", [], builders.BuildContext(), None, "img")
    job_pod = job["spec"]["template"]
    assert (job_pod["spec"]["serviceAccountName"], job_pod["spec"]["imagePullSecrets"]) == ("wan-engine", [
        {"name": "registry"}])
    assert "sidecar.istio.io/inject" not in (job_pod["metadata"].get("annotations") or {})
    claim = parse_spec({"model": {"path": "/m"}, "lora": {"claimName": "adapters", "subPath": "wan"}})
    sts = builders.build_statefulset(OWNER, claim, "resident")["spec"]["template"]["spec"]
    assert {"name": "lora", "persistentVolumeClaim": {"claimName": "adapters", "readOnly": True}} in sts["volumes"]
    assert {"name": "lora", "mountPath": "/lora", "readOnly": True, "subPath": "wan"} in sts["containers"][0][
        "volumeMounts"]


def test_one_pod_per_node_by_required_anti_affinity_kept_beside_user_affinity():
    objs = build("claim-rolling-vllm-omni-rank-local")
    affinity = objs[3]["spec"]["template"]["spec"]["affinity"]
    assert "nodeAffinity" in affinity
    (term,) = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == builders.selector_labels("wan")


def test_engine_command_dlo_and_vllm_omni():
    spec = parse_spec({"model": {"path": "/m"}, "devicesPerNode": 4, "engine": {"device": "cuda"}})
    assert builders.engine_command(spec, "allgather")[:9] == [
        "dlo", "serve", "/model", "--dp", "4", "--mode", "allgather", "--device", "cuda"
    ]
    omni = parse_spec({"model": {"path": "/m"}, "devicesPerNode": 4, "engine": {"kind": "vllm-omni"}})
    ag = builders.engine_command(omni, "allgather")
    assert ag[:4] == ["vllm", "serve", "/model", "--omni"]
    assert "--enable-distributed-layerwise-offload" in ag and "--dlo-no-use-allgather" not in ag
    assert ag[ag.index("--num-gpus") + 1] == "4"
    assert "--data-parallel-size" not in ag  # vllm-omni refuses it under --omni
    assert "--dlo-no-use-allgather" in builders.engine_command(omni, "rank-local")
    assert "--enable-distributed-layerwise-offload" not in builders.engine_command(omni, "resident")


def test_engine_command_dp_x_sp_and_the_accelerator_limit_stays_devices_per_node():
    spec = parse_spec({"model": {"path": "/m"}, "devicesPerNode": 4, "sp": 2, "engine": {"device": "cuda"}})
    assert spec.dp == 2
    assert builders.engine_command(spec, "allgather")[:11] == [
        "dlo", "serve", "/model", "--dp", "2", "--sp", "2", "--mode", "allgather", "--device", "cuda"
    ]
    one = parse_spec({"model": {"path": "/m"}, "devicesPerNode": 2, "engine": {"device": "cuda"}})
    assert "--sp" not in builders.engine_command(one, "allgather")  # sp 1: the command as before
    sts = builders.build_statefulset(OWNER, spec, "allgather")
    engine = sts["spec"]["template"]["spec"]["containers"][0]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 4  # every rank of dp x sp has its device


def test_pod_is_non_root_read_only_without_escalation_and_ipc_lock_only_when_asked():
    for case, lock in [("example-allgather", False), ("claim-rolling-vllm-omni-rank-local", True)]:
        pod = build(case)[3]["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            wants_lock = lock and c["name"] == "engine"  # the warmer never pins
            assert sc["capabilities"].get("add", []) == (["IPC_LOCK"] if wants_lock else [])


def test_warmer_init_container_mounts_the_model_read_only():
    pod = build("example-allgather")[3]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == ["dlo", "warm", "/model", "--threshold", "0.99"]
    assert {"name": "model", "mountPath": "/model", "readOnly": True} in init["volumeMounts"]
    assert pod["volumes"][0] == {"name": "model", "hostPath": {"path": "/models/wan2.1-14b", "type": "Directory"}}
    assert "initContainers" not in build("cpu-no-warmer-podmonitor")[3]["spec"]["template"]["spec"]


def test_api_key_from_secret_probes_and_shm():
    pod = build("example-allgather")[3]["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    key = next(e for e in engine["env"] if e["name"] == "DLO_API_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "wan-api-key", "key": "api-key"}
    assert engine["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}  # 1Gi per rank, dp 8
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 8


def test_cpu_engine_requests_no_accelerator_but_memory_and_cpu():
    engine = build("cpu-no-warmer-podmonitor")[3]["spec"]["template"]["spec"]["containers"][0]
    assert "limits" not in engine["resources"]
    assert engine["resources"]["requests"] == {"cpu": "1", "memory": "2048Mi"}  # no facts: 2 GiB per rank


def test_template_hash_changes_with_the_mode_and_only_then():
    spec = parse_spec(example_spec())
    a = builders.pod_template(OWNER, spec, "allgather")
    b = builders.pod_template(OWNER, spec, "allgather")
    c = builders.pod_template(OWNER, spec, "rank-local")
    h = builders.TEMPLATE_HASH
    assert a["metadata"]["annotations"][h] == b["metadata"]["annotations"][h]
    assert a["metadata"]["annotations"][h] != c["metadata"]["annotations"][h]
    assert builders.template_hash(a) == a["metadata"]["annotations"][h]


def test_vllm_omni_pods_probe_what_vllm_serves_and_get_the_key_as_vllm_reads_it():
    spec = parse_spec({"model": {"path": "/m"}, "engine": {"kind": "vllm-omni", "apiKeySecret": {"name": "k"}}})
    engine = builders.build_statefulset(OWNER, spec, "allgather")["spec"]["template"]["spec"]["containers"][0]
    # vLLM serves /health and /v1/models (the latter behind the API key), no /ready
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert engine[probe]["httpGet"]["path"] == "/health", probe
    keys = [e for e in engine["env"] if "API_KEY" in e["name"]]
    assert keys == [{"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {"name": "k", "key": "api-key"}}}]
    assert not any("key" in a for a in engine["command"])  # never on the command line


def test_engine_switches_are_typed_fields_passed_as_the_serve_flags_of_their_names():
    """Issue 26: spec.engine.{gather, gatherMaxCtas, ulyssesExchange, registerEarly} become the
    `dlo serve` flags of the same names; unset, the command is what it was; `dlo serve` accepts them."""
    from dlo.serving.serve import add_arguments

    spec = parse_spec({"model": {"path": "/m"}, "devicesPerNode": 4, "sp": 2, "mode": "allgather",
                       "engine": {"device": "cuda", "gather": "peer", "gatherMaxCtas": 8, "ulyssesExchange": "lean",
                                  "registerEarly": False}})
    cmd = builders.engine_command(spec, "allgather")
    tail = cmd[cmd.index("--shutdown-grace") + 2:]
    assert tail == ["--gather", "peer", "--gather-max-ctas", "8", "--ulysses-exchange", "lean", "--no-register-early"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(cmd[2:])
    assert (args.gather, args.gather_max_ctas, args.ulysses_exchange, args.register_early) == ("peer", 8, "lean", False)
    plain = parse_spec({"model": {"path": "/m"}, "devicesPerNode": 2, "engine": {"registerEarly": True}})
    assert builders.engine_command(plain, "allgather")[-1] == "--register-early"
    bare = builders.engine_command(parse_spec({"model": {"path": "/m"}}), "rank-local")
    assert not any(a.startswith(("--gather", "--ulysses", "--register", "--no-register")) for a in bare)


@pytest.mark.parametrize("name", ["DLO_GATHER", "DLO_GATHER_MAX_CTAS", "DLO_ULYSSES", "DLO_REGISTER_EARLY"])
def test_engine_env_may_not_set_a_switch_that_has_its_field(name):
    from dlo.operator.models import SpecError

    with pytest.raises(SpecError, match=f"engine.env must not set .*{name}.*: set the engine fields"):
        parse_spec({"model": {"path": "/m"}, "engine": {"env": [{"name": name, "value": "1"}]}})


@pytest.mark.parametrize("name", ["DLO_API_KEY", "VLLM_API_KEY"])
def test_engine_env_may_not_set_either_api_key_variable(name):
    from dlo.operator.models import SpecError

    with pytest.raises(SpecError, match="must not set DLO_API_KEY or VLLM_API_KEY"):
        parse_spec({"model": {"path": "/m"}, "engine": {"kind": "vllm-omni", "env": [{"name": name, "value": "x"}]}})


def test_engine_image_default_is_filled_in_and_the_spec_wins():
    from dlo.operator.models import DEFAULT_IMAGE, with_default_image

    spec = parse_spec({"model": {"path": "/m"}})
    pod = builders.pod_template(OWNER, spec, "allgather")["spec"]
    assert pod["containers"][0]["image"] == DEFAULT_IMAGE == pod["initContainers"][0]["image"]
    pod = builders.pod_template(OWNER, with_default_image(spec, "reg/dlo:9"), "allgather")["spec"]
    assert pod["containers"][0]["image"] == "reg/dlo:9" == pod["initContainers"][0]["image"]
    named = with_default_image(parse_spec({"model": {"path": "/m"}, "engine": {"image": "mine:1"}}), "reg/dlo:9")
    assert builders.pod_template(OWNER, named, "allgather")["spec"]["containers"][0]["image"] == "mine:1"


def test_service_url_names_the_client_service_and_port():
    spec = parse_spec({"model": {"path": "/m"}, "service": {"port": 8080}})
    client = builders.build_client_service(OWNER, spec)
    assert builders.service_url(OWNER, spec) == f"http://{client['metadata']['name']}.serving.svc:8080"


def test_dlo_pods_keep_videos_on_an_empty_dir_and_reach_each_other_through_the_headless_service():
    spec = parse_spec({"model": {"path": "/m"}, "replicas": 2, "engine": {"device": "cpu"},
                       "service": {"port": 8080}})
    template = builders.pod_template(OWNER, spec, "resident")
    (engine,) = template["spec"]["containers"]
    cmd = engine["command"]
    assert cmd[cmd.index("--video-dir") + 1] == builders.VIDEO_MOUNT
    assert {"name": "videos", "mountPath": builders.VIDEO_MOUNT} in engine["volumeMounts"]
    assert {"name": "videos", "emptyDir": {}} in template["spec"]["volumes"]
    env = {e["name"]: e for e in engine["env"]}
    assert env["DLO_POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    headless = builders.build_headless_service(OWNER, spec)["metadata"]["name"]
    assert env["DLO_PEER_URL_TEMPLATE"]["value"] == f"http://{{pod}}.{headless}.{OWNER.namespace}.svc:8080"
    omni = parse_spec({"model": {"path": "/m"}, "engine": {"kind": "vllm-omni"}})
    (omni_engine,) = builders.pod_template(OWNER, omni, "resident")["spec"]["containers"]
    assert "--video-dir" not in omni_engine["command"]
    assert "DLO_PEER_URL_TEMPLATE" not in {e["name"] for e in omni_engine["env"]}


@pytest.mark.parametrize("grace", [0, 25, 120])
def test_termination_grace_covers_the_engine_drain(grace):
    """The pod outlives the engine's drain (`--shutdown-grace`) by 5 s: Kubernetes' SIGKILL never
    cuts a drain short."""
    spec = parse_spec({"model": {"path": "/models/tiny"}, "engine": {"shutdownGraceSeconds": grace}})
    sts = builders.build_statefulset(OWNER, spec, "allgather")
    pod = sts["spec"]["template"]["spec"]
    cmd = pod["containers"][0]["command"] if "command" in pod["containers"][0] else pod["containers"][0]["args"]
    assert cmd[cmd.index("--shutdown-grace") + 1] == str(grace)
    assert pod["terminationGracePeriodSeconds"] == grace + 5
