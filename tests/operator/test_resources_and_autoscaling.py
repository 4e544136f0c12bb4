"""The builders' cluster operations: container resources (never BestEffort), the autoscaling
objects, the shared video claim, the model placement of a fetched model, and the status warnings."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest

from dlo.operator import advice, autoscale_builder, builders, modes
from dlo.operator.models import SpecError, parse_spec
from dlo.operator.names import BuildContext, Owner, model_label
from dlo.operator.resources import engine_resources, quantity_bytes

ROOT = Path(__file__).resolve().parents[2]
OWNER = Owner("wan", "serving")


def h200_node(models: dict | None = None) -> dict:
    profile = json.loads((ROOT / "examples" / "profiles" / "h200-node.json").read_text())
    if models is not None:
        profile["models"] = models
    return {"metadata": {"name": "n0", "labels": {}, "annotations": {"dlo.dev/node-profile": json.dumps(profile)}},
            "spec": {}, "status": {"allocatable": {"nvidia.com/gpu": "8"}}}


def test_engine_memory_request_is_the_plans_per_pod_estimate_and_cpu_one_per_rank():
    spec = parse_spec({"model": {"path": "/models/wan2.1-14b"}, "devicesPerNode": 8, "mode": "allgather"})
    memory = modes.pod_memory_bytes(spec, [h200_node()], "allgather")
    # 28.6 GB of page cache (registered: no second copy) + 8 ranks of runtime
    assert memory is not None and 28.6e9 + 8 * 91e6 < memory < 28.6e9 + 8 * (91e6 + 0.11 * 28.6e9)
    resources = engine_resources(spec, memory)
    assert quantity_bytes(resources["requests"]["memory"]) >= memory
    assert resources["requests"]["cpu"] == "8"
    assert resources["limits"] == {"nvidia.com/gpu": 8} and resources["requests"]["nvidia.com/gpu"] == 8
    assert "memory" not in resources["limits"]  # pinned pages cannot be reclaimed: no limit by default


def test_rank_local_without_registration_asks_for_every_ranks_copy():
    profile_node = h200_node()
    raw = json.loads(profile_node["metadata"]["annotations"]["dlo.dev/node-profile"])
    raw["can_register_page_cache"] = False
    profile_node["metadata"]["annotations"]["dlo.dev/node-profile"] = json.dumps(raw)
    spec = parse_spec({"model": {"path": "/models/wan2.1-14b"}, "devicesPerNode": 4, "mode": "rank-local"})
    assert modes.pod_memory_bytes(spec, [profile_node], "rank-local") > 5 * 28.6e9  # page cache + 4 arenas


def test_overrides_win_key_by_key_and_a_request_never_exceeds_its_limit():
    spec = parse_spec({"model": {"path": "/m"}, "engine": {"resources": {"requests": {"cpu": "3"},
                                                                       "limits": {"memory": "1Gi"}}}})
    resources = engine_resources(spec, 64 * 2**30)
    assert resources["requests"]["cpu"] == "3"
    assert resources["requests"]["memory"] == "1Gi" and resources["limits"]["memory"] == "1Gi"


@pytest.mark.parametrize("raw", [
    {"model": {"path": "/m"}},
    {"model": {"path": "/m"}, "warmer": {"resources": {"requests": {"memory": "1Gi"}}}},
    {"model": {"uri": "hf://org/name"}, "placement": {"modelAffinity": "preferred"}},
    {"model": {"claimName": "c"}, "engine": {"kind": "vllm-omni"}},
])
def test_every_container_has_cpu_and_memory_requests(raw):
    pod = builders.build_statefulset(OWNER, parse_spec(raw), "allgather")["spec"]["template"]["spec"]
    containers = pod["containers"] + pod.get("initContainers", [])
    assert len(containers) >= 2
    for c in containers:
        assert c["resources"]["requests"].get("cpu") and c["resources"]["requests"].get("memory"), c["name"]


def test_required_model_affinity_is_added_to_every_node_selector_term_of_the_user():
    user = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]}}}
    spec = parse_spec({"model": {"uri": "s3://models/wan"}, "placement": {"affinity": user}})
    pod = builders.build_statefulset(OWNER, spec, "allgather")["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    holds = {"key": model_label(spec.model.cache_key), "operator": "Exists"}
    assert [t["matchExpressions"][-1] for t in terms] == [holds, holds]  # zone a AND holds, OR zone b AND holds
    assert "initContainers" in pod and [c["name"] for c in pod["initContainers"]] == ["warm"]


def test_preferred_model_affinity_fetches_in_an_init_container_that_evicts_nothing():
    spec = parse_spec({"model": {"uri": "s3://models/wan", "secretRef": {"name": "s"}},
                       "placement": {"modelAffinity": "preferred"}})
    pod = builders.build_statefulset(OWNER, spec, "allgather", BuildContext(cache_root="/var/cache/dlo"))["spec"]["template"]["spec"]
    # the cache handed to the fetch's non-root user first (cacheOwnership: chown, the default), then fetch, warm
    assert [c["name"] for c in pod["initContainers"]] == ["cache-owner", "fetch", "warm"]
    fetch = pod["initContainers"][1]
    assert "--no-evict" in fetch["command"] and fetch["command"][3] == f"/cache/{spec.model.cache_key}"
    (engine,) = pod["containers"]
    mount = next(m for m in engine["volumeMounts"] if m["mountPath"] == "/model")
    assert mount == {"name": "model-cache", "mountPath": "/model", "readOnly": True, "subPath": spec.model.cache_key}
    preferred = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred[0]["preference"]["matchExpressions"][0]["key"] == model_label(spec.model.cache_key)


def test_videos_claim_replaces_the_empty_dir():
    spec = parse_spec({"model": {"path": "/m"}, "videos": {"claimName": "videos"}})
    volumes = {v["name"]: v for v in builders.build_statefulset(OWNER, spec, "allgather")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["videos"] == {"name": "videos", "persistentVolumeClaim": {"claimName": "videos"}}


def test_autoscaling_objects_are_valid_and_target_the_scale_subresource():
    spec = parse_spec({"model": {"path": "/m"}, "devicesPerNode": 4, "autoscaling": {
        "enabled": True, "minReplicas": 2, "maxReplicas": 6, "targetQueueDepthPerRank": 0.5}})
    hpa = autoscale_builder.build_hpa(OWNER, spec)
    kubernetes_validate.validate(hpa, "1.37", strict=True)
    assert hpa["spec"]["minReplicas"] == 2 and hpa["spec"]["maxReplicas"] == 6
    metric = hpa["spec"]["metrics"][0]["external"]
    assert metric["target"] == {"type": "AverageValue", "averageValue": "2000m"}  # 0.5 per rank x 4 ranks
    assert metric["metric"] == {"name": "dlo_engine_load", "selector": {"matchLabels": {
        "namespace": "serving", "deployment": "wan"}}}
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "dlo.dev/v1alpha1", "kind": "DLODeployment", "name": "wan"}
    keda = autoscale_builder.build_scaled_object(OWNER, spec, BuildContext(prometheus_url="http://prom:9090"))
    assert keda["spec"]["minReplicaCount"] == 2 and keda["spec"]["triggers"][0]["metadata"]["threshold"] == "2"
    objects = builders.build_all(OWNER, spec, "allgather", False, BuildContext(autoscaler="hpa"))
    assert [o["kind"] for o in objects][-1] == "HorizontalPodAutoscaler"
    assert "HorizontalPodAutoscaler" not in [o["kind"] for o in builders.build_all(OWNER, spec, "allgather", False)]


def test_status_warns_when_the_limits_allow_video_jobs_longer_than_the_drain():
    spec = parse_spec({"model": {"path": "/m"}, "engine": {"args": ["--max-steps", "50"], "shutdownGraceSeconds": 60},
                       "videos": {"secondsPerStep": 3.0, "claimName": "v"}})
    (warning,) = advice.warnings(spec, None)
    assert "150 s (50 steps from --max-steps x 3 s per step)" in warning and "at least 150" in warning
    ok = parse_spec({"model": {"path": "/m"}, "engine": {"args": ["--small-limits"], "shutdownGraceSeconds": 60},
                     "videos": {"secondsPerStep": 3.0}})
    assert advice.warnings(ok, None) == []  # 4 steps x 3 s
    scaling = parse_spec({"model": {"path": "/m"}, "autoscaling": {"enabled": True}})
    assert any("emptyDir" in w for w in advice.warnings(scaling, "hpa"))


@pytest.mark.parametrize("engine", ["auto", "keda", "hpa"])
def test_scale_to_zero_is_refused_saying_what_to_use(engine):
    """With no engine nothing reports the load: minReplicas 0 would never scale up again."""
    with pytest.raises(SpecError, match="autoscaling.minReplicas 0 is refused") as refused:
        parse_spec({"model": {"path": "/m"}, "autoscaling": {"enabled": True, "minReplicas": 0, "engine": engine}})
    assert "use minReplicas 1" in str(refused.value) and "spec.replicas 0" in str(refused.value)
    assert "KEDA's HTTP add-on" in str(refused.value)
    assert parse_spec({"model": {"path": "/m"}, "replicas": 0}).replicas == 0  # by hand, without autoscaling
