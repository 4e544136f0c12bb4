"""operator/handlers.py against the kmock API emulator: real HTTP, real kopf, in its own thread."""

import asyncio
import json
import time
from pathlib import Path

from cluster import dlodeployment, running_cluster
from controllers import healthy
from dlo.operator import builders, metrics
from dlo.operator.models import API_VERSION

ROOT = Path(__file__).resolve().parents[2]
NS = "serving"
SPEC = {"model": {"path": "/models/wan2.1-14b"}, "replicas": 2, "devicesPerNode": 8, "mode": "auto"}
RECREATE = {**SPEC, "rollout": {"type": "Recreate"}}
CHILDREN = [("Service", "wan-headless"), ("Service", "wan"), ("PodDisruptionBudget", "wan"), ("StatefulSet", "wan")]


def status_of(cluster, name="wan"):
    obj = cluster.get("DLODeployment", NS, name)
    return (obj or {}).get("status") or {}


def condition(cluster, type_, name="wan"):
    return next((c for c in status_of(cluster, name).get("conditions", []) if c["type"] == type_), None)


def gpu_node_profile(name: str, profile_file: str) -> dict:
    profile = json.loads((ROOT / "examples" / "profiles" / profile_file).read_text())
    return {"dlo.dev/node-profile": json.dumps(profile)}


async def add_gpu_nodes(cluster, profile_file="h200-node.json", count=2):
    for i in range(count):
        await cluster.add_node(f"node-{i}", annotations=gpu_node_profile(f"node-{i}", profile_file),
                               allocatable={"nvidia.com/gpu": "8"})


async def test_create_makes_owned_children_resolves_mode_and_reports_ready():
    async with running_cluster() as cluster:
        await add_gpu_nodes(cluster)
        await cluster.create(dlodeployment("wan", NS, SPEC))
        await cluster.wait(lambda: all(cluster.get(k, NS, n) for k, n in CHILDREN), what="children")
        owner_uid = cluster.get("DLODeployment", NS, "wan")["metadata"]["uid"]
        for kind, name in CHILDREN:
            (ref,) = cluster.get(kind, NS, name)["metadata"]["ownerReferences"]
            assert (ref["uid"], ref["kind"], ref["controller"]) == (owner_uid, "DLODeployment", True)
            assert ref["apiVersion"] == API_VERSION
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
        status = status_of(cluster)
        assert status["mode"] == "resident" and "fits one device" in status["modeReason"]
        assert (status["replicas"], status["readyReplicas"], status["updatedReplicas"]) == (2, 2, 2)
        assert status["selector"] == builders.selector_string("wan")
        assert status["observedGeneration"] == 1
        assert [n["name"] for n in status["nodes"]] == ["node-0", "node-1"]
        assert status["nodes"][0]["cachedRatio"] == 0.998 and status["cachedRatio"] == 0.998
        assert condition(cluster, "CacheWarmed")["status"] == "True"
        assert condition(cluster, "Degraded")["status"] == "False"
        sts = cluster.get("StatefulSet", NS, "wan")
        assert "--mode" in (cmd := sts["spec"]["template"]["spec"]["containers"][0]["command"])
        assert cmd[cmd.index("--mode") + 1] == "resident"
        await cluster.wait(lambda: cluster.events("ModeResolved"), what="ModeResolved event")
        assert cluster.events("StatefulSetCreated")


def ready_after(seconds: float):
    """`ready_when` for the emulated StatefulSet: a pod turns ready `seconds` after it is first seen
    scheduled (an engine loading), so a rollout has replacements that are not ready yet."""
    seen: dict[str, float] = {}

    def ready(pod: dict) -> bool:
        return time.monotonic() - seen.setdefault(pod["metadata"]["uid"], time.monotonic()) >= seconds

    return ready


def template_hash(cluster, name="wan"):
    return cluster.get("StatefulSet", NS, name)["spec"]["template"]["metadata"]["annotations"][builders.TEMPLATE_HASH]


def rolled(cluster, old_uids: dict[str, str], replicas: int = 2):
    """Every pod replaced (a new uid) onto the StatefulSet's current template and healthy."""
    want = template_hash(cluster)
    pods = cluster.objects("Pod", NS)
    return len(pods) == replicas and all(
        p["metadata"]["annotations"][builders.TEMPLATE_HASH] == want and p["metadata"]["uid"] != old_uids.get(
            p["metadata"]["name"]) and healthy(p) for p in pods)


def uids(cluster) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.objects("Pod", NS)}


async def test_a_spec_edit_on_four_replicas_rolls_one_pod_at_a_time_by_default():
    """RollingUpdate is the default: a spec edit replaces the pods one by one, each replacement ready
    before the next pod goes; sampled all along, never more than one of the four pods is down."""
    async with running_cluster(ready_when=ready_after(0.5)) as cluster:
        await add_gpu_nodes(cluster, count=4)
        await cluster.create(dlodeployment("wan", NS, {**SPEC, "replicas": 4}))
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
        sts = cluster.get("StatefulSet", NS, "wan")
        assert sts["spec"]["updateStrategy"] == {"type": "RollingUpdate",
                                                 "rollingUpdate": {"partition": 0, "maxUnavailable": 1}}
        old = uids(cluster)
        down: list[int] = []
        sampling = True

        async def sample() -> None:
            while sampling:
                down.append(4 - sum(1 for p in cluster.objects("Pod", NS) if healthy(p)))
                await asyncio.sleep(0.02)

        sampler = asyncio.create_task(sample())
        await cluster.patch_dlod(NS, "wan", {"spec": {"engine": {"shutdownGraceSeconds": 30}}})
        try:
            await cluster.wait(lambda: rolled(cluster, old, replicas=4), timeout=60, what="four pods rolled")
        finally:
            sampling = False
            await sampler
        assert max(down) == 1, f"pods down at once while rolling: {max(down)}"
        assert down.count(1) >= 4  # each replaced pod was down a while (not ready at once)
        assert not cluster.events("PodRecreated")  # the StatefulSet rolled them, not the operator


async def test_a_rollout_never_waits_on_a_pod_of_an_old_template_that_is_not_ready():
    """The StatefulSet's rollout counts an unready pod as unavailable and would wait on it for ever
    (maxUnavailable 1 used up): the operator deletes stale pods that serve nothing, and the rollout
    goes on."""
    async with running_cluster() as cluster:
        await add_gpu_nodes(cluster)
        await cluster.create(dlodeployment("wan", NS, SPEC))
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
        old = uids(cluster)
        await cluster.call(cluster.kube.patch, "v1", "Pod", NS, "wan-0",
                           {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
        await cluster.wait(lambda: status_of(cluster).get("readyReplicas") == 1, what="wan-0 not ready")
        await cluster.patch_dlod(NS, "wan", {"spec": {"engine": {"shutdownGraceSeconds": 30}}})
        await cluster.wait(lambda: rolled(cluster, old), what="both pods rolled")
        (replaced,) = cluster.events("PodReplaced")
        assert "wan-0" in replaced["message"]


async def test_mode_change_rolls_pods_with_recreate():
    """Recreate (an outage: every pod on an old template goes at once) stays available."""
    async with running_cluster() as cluster:
        await add_gpu_nodes(cluster)
        await cluster.create(dlodeployment("wan", NS, RECREATE))
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
        old = {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.objects("Pod", NS)}
        await cluster.patch_dlod(NS, "wan", {"spec": {"mode": "rank-local"}})
        await cluster.wait(lambda: status_of(cluster).get("mode") == "rank-local", what="mode change")
        sts = cluster.get("StatefulSet", NS, "wan")
        assert sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
        want = sts["spec"]["template"]["metadata"]["annotations"][builders.TEMPLATE_HASH]

        def rolled():
            pods = cluster.objects("Pod", NS)
            return len(pods) == 2 and all(
                p["metadata"]["annotations"][builders.TEMPLATE_HASH] == want and p["metadata"]["uid"] != old[p["metadata"]["name"]]
                for p in pods
            )

        await cluster.wait(rolled, what="pods recreated on the new template")
        await cluster.wait(lambda: len(cluster.events("PodRecreated")) >= 2, what="PodRecreated events")
        await cluster.wait(lambda: status_of(cluster).get("observedGeneration") == 2
                           and (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready again")
        assert cluster.events("ModeChanged")


async def test_the_plan_is_pinned_an_inventory_change_only_says_so_and_a_replan_applies_it():
    """A profile change that would give another plan replaces no pod: PlanOutdated names the change
    and the command; the replan annotation applies it (and the pods roll)."""
    async with running_cluster() as cluster:
        await add_gpu_nodes(cluster)
        await cluster.create(dlodeployment("wan", NS, SPEC))
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
        assert status_of(cluster)["plan"]["mode"] == "resident" and status_of(cluster)["plan"]["generation"] == 1
        pods = {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.objects("Pod", NS)}
        await cluster.call(cluster.kube.patch, "v1", "Node", None, "node-1",
                           {"metadata": {"annotations": gpu_node_profile("node-1", "l4-node.json")}})
        await cluster.wait(lambda: (condition(cluster, "PlanOutdated") or {}).get("status") == "True",
                           what="PlanOutdated")
        message = condition(cluster, "PlanOutdated")["message"]
        assert "mode resident -> allgather" in message and "dlo.dev/replan" in message and "node node-1" in message
        assert status_of(cluster)["mode"] == "resident" and cluster.events("PlanOutdated")
        assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.objects("Pod", NS)} == pods
        assert not cluster.events("ModeChanged")
        await cluster.patch_dlod(NS, "wan", {"metadata": {"annotations": {"dlo.dev/replan": "1"}}})
        await cluster.wait(lambda: status_of(cluster).get("mode") == "allgather", what="the replan applied")
        assert status_of(cluster)["plan"]["replan"] == "1" and cluster.events("ModeChanged")
        await cluster.wait(lambda: (condition(cluster, "PlanOutdated") or {}).get("status") == "False",
                           what="PlanOutdated cleared")
        await cluster.wait(lambda: rolled(cluster, pods), what="the pods roll on the new plan")


async def test_a_node_of_another_accelerator_joins_no_pod_is_deleted_and_a_spec_edit_rolls():
    async with running_cluster() as cluster:
        await add_gpu_nodes(cluster)
        await cluster.create(dlodeployment("wan", NS, SPEC))
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
        sts_hash = cluster.get("StatefulSet", NS, "wan")["spec"]["template"]["metadata"]["annotations"][
            builders.TEMPLATE_HASH]
        pods = {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.objects("Pod", NS)}
        await cluster.add_node("node-l4", annotations=gpu_node_profile("node-l4", "l4-node.json"),
                               allocatable={"nvidia.com/gpu": "8"})
        await cluster.wait(lambda: (condition(cluster, "PlanOutdated") or {}).get("status") == "True",
                           what="PlanOutdated")
        assert "node node-l4" in condition(cluster, "PlanOutdated")["message"]
        sts = cluster.get("StatefulSet", NS, "wan")
        assert sts["spec"]["template"]["metadata"]["annotations"][builders.TEMPLATE_HASH] == sts_hash
        assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.objects("Pod", NS)} == pods
        assert status_of(cluster)["plan"]["mode"] == "resident"
        # a spec edit plans again from the inventory as it is, and rolls
        await cluster.patch_dlod(NS, "wan", {"spec": {"engine": {"shutdownGraceSeconds": 30}}})
        await cluster.wait(lambda: status_of(cluster).get("plan", {}).get("generation") == 2, what="a new plan")
        assert status_of(cluster)["plan"]["mode"] == "allgather"
        assert len(status_of(cluster)["plan"]["nodeTypes"]) == 2
        await cluster.wait(lambda: rolled(cluster, pods), what="the spec edit rolls")


async def test_scale_by_patching_spec_replicas():
    async with running_cluster() as cluster:
        await add_gpu_nodes(cluster, count=3)
        await cluster.create(dlodeployment("wan", NS, SPEC))
        await cluster.wait(lambda: status_of(cluster).get("readyReplicas") == 2, what="2 ready")
        await cluster.patch_dlod(NS, "wan", {"spec": {"replicas": 3}})
        await cluster.wait(lambda: cluster.get("StatefulSet", NS, "wan")["spec"]["replicas"] == 3, what="sts scaled")
        await cluster.wait(lambda: status_of(cluster).get("readyReplicas") == 3, what="3 ready")
        await cluster.patch_dlod(NS, "wan", {"spec": {"replicas": 1}})
        await cluster.wait(lambda: cluster.get("StatefulSet", NS, "wan")["spec"]["replicas"] == 1, what="sts scaled down")
        await cluster.wait(lambda: len(cluster.objects("Pod", NS)) == 1, what="pod removed")
        await cluster.wait(lambda: status_of(cluster).get("replicas") == 1, what="status scaled down")
        assert status_of(cluster)["observedGeneration"] == 3


async def test_invalid_spec_sets_degraded_instead_of_crashing_then_recovers():
    async with running_cluster() as cluster:
        bad = {**SPEC, "model": {"path": "/models/wan2.1-14b", "claimName": "models"}}
        await cluster.create(dlodeployment("wan", NS, bad))
        await cluster.wait(lambda: (condition(cluster, "Degraded") or {}).get("status") == "True", what="Degraded")
        degraded = condition(cluster, "Degraded")
        assert degraded["reason"] == "InvalidSpec" and "exactly one of model.path" in degraded["message"]
        assert condition(cluster, "Ready")["status"] == "False"
        assert cluster.get("StatefulSet", NS, "wan") is None
        await cluster.wait(lambda: cluster.events("InvalidSpec"), what="an InvalidSpec Event")
        await cluster.patch_dlod(NS, "wan", {"spec": {"model": {"claimName": None}}})
        await cluster.wait(lambda: (condition(cluster, "Degraded") or {}).get("status") == "False", what="recovered")
        # the status patch and the StatefulSet are separate writes: wait for the state, not the order
        await cluster.wait(lambda: cluster.get("StatefulSet", NS, "wan"), what="the StatefulSet after recovery")


async def test_delete_removes_children_through_owner_references():
    async with running_cluster() as cluster:
        await add_gpu_nodes(cluster)
        await cluster.create(dlodeployment("wan", NS, SPEC))
        await cluster.wait(lambda: len(cluster.objects("Pod", NS)) == 2, what="pods")
        assert await cluster.delete_dlod(NS, "wan")
        await cluster.wait(
            lambda: not any(cluster.objects(k, NS) for k in ("StatefulSet", "Service", "PodDisruptionBudget", "Pod")),
            what="children collected",
        )
        assert cluster.get("DLODeployment", NS, "wan") is None


async def test_reconcile_is_idempotent_children_are_not_rewritten():
    async with running_cluster() as cluster:
        await add_gpu_nodes(cluster)
        await cluster.create(dlodeployment("wan", NS, SPEC))
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
        versions = {k: cluster.get(k, NS, n)["metadata"]["resourceVersion"] for k, n in CHILDREN}
        def reconciles() -> float:
            return metrics.REGISTRY.get_sample_value("dlo_operator_reconciles_total", {"result": "success"}) or 0.0

        before = reconciles()  # several timer rounds, counted (a sleep may see none on a busy machine)
        await cluster.wait(lambda: reconciles() >= before + 3, timeout=120, what="three more reconciles")
        assert {k: cluster.get(k, NS, n)["metadata"]["resourceVersion"] for k, n in CHILDREN} == versions


async def test_rolling_update_leaves_replacement_to_the_statefulset_and_switches_back_cleanly():
    async with running_cluster() as cluster:
        await add_gpu_nodes(cluster)
        rolling = {**SPEC, "mode": "allgather", "rollout": {"type": "RollingUpdate", "maxUnavailable": 1}}
        await cluster.create(dlodeployment("wan", NS, rolling))
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
        sts = cluster.get("StatefulSet", NS, "wan")
        assert sts["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"partition": 0, "maxUnavailable": 1}}
        await cluster.patch_dlod(NS, "wan", {"spec": {"mode": "rank-local"}})
        await cluster.wait(lambda: status_of(cluster).get("updatedReplicas") == 2
                           and status_of(cluster).get("mode") == "rank-local", what="pods replaced")
        assert not cluster.events("PodRecreated")  # the StatefulSet controller rolled them
        await cluster.patch_dlod(NS, "wan", {"spec": {"rollout": {"type": "Recreate", "maxUnavailable": None}}})
        await cluster.wait(lambda: cluster.get("StatefulSet", NS, "wan")["spec"]["updateStrategy"] == {"type": "OnDelete"},
                           what="OnDelete without a stale rollingUpdate")


async def test_crash_looping_engine_pod_sets_degraded_until_it_recovers():
    async with running_cluster() as cluster:
        await add_gpu_nodes(cluster)
        await cluster.create(dlodeployment("wan", NS, SPEC))
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
        crashing = {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}],
                               "containerStatuses": [{"name": "engine", "ready": False, "restartCount": 4,
                                                      "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                                      "lastState": {"terminated": {"exitCode": 1, "reason": "Error"}}}]}}
        await cluster.call(cluster.kube.patch, "v1", "Pod", NS, "wan-1", crashing)
        await cluster.wait(lambda: (condition(cluster, "Degraded") or {}).get("status") == "True", what="Degraded")
        degraded = condition(cluster, "Degraded")
        assert degraded["reason"] == "EngineCrashLooping"
        assert degraded["message"] == "pod wan-1 container engine: CrashLoopBackOff, 4 restarts, last exit 1 (Error)"
        assert condition(cluster, "Ready")["status"] == "False"
        await cluster.wait(lambda: cluster.events("EngineCrashLooping"), what="a Warning Event")
        recovered = {"status": {"conditions": [{"type": "Ready", "status": "True"}],
                                "containerStatuses": [{"name": "engine", "ready": True, "restartCount": 4,
                                                       "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]}}
        await cluster.call(cluster.kube.patch, "v1", "Pod", NS, "wan-1", recovered)
        await cluster.wait(lambda: (condition(cluster, "Degraded") or {}).get("status") == "False", what="cleared")
        assert condition(cluster, "Degraded")["reason"] == "SpecValid"
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready again")
        assert len(cluster.events("EngineCrashLooping")) == 1


async def test_status_url_names_the_client_service():
    async with running_cluster() as cluster:
        await add_gpu_nodes(cluster)
        await cluster.create(dlodeployment("wan", NS, {**SPEC, "service": {"port": 8080}}))
        await cluster.wait(lambda: status_of(cluster).get("url"), what="url")
        assert status_of(cluster)["url"] == f"http://wan.{NS}.svc:8080"
        assert cluster.get("Service", NS, "wan")["spec"]["ports"][0]["port"] == 8080


async def test_changes_reach_the_status_through_watches_not_the_resync():
    """With a resync of a minute, a spec change, a pod turning unready and a node's new profile
    still reach the status within seconds: each wakes the resource's reconcile."""
    async with running_cluster(status_interval=60.0) as cluster:
        await add_gpu_nodes(cluster)
        await cluster.create(dlodeployment("wan", NS, SPEC))
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
        await cluster.call(cluster.kube.patch, "v1", "Pod", NS, "wan-1",
                           {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
        await cluster.wait(lambda: status_of(cluster).get("readyReplicas") == 1, timeout=10, what="the pod's change")
        await cluster.call(cluster.kube.patch, "v1", "Node", None, "node-1",
                           {"metadata": {"annotations": gpu_node_profile("node-1", "l4-node.json")}})
        await cluster.wait(lambda: (condition(cluster, "PlanOutdated") or {}).get("status") == "True", timeout=10,
                           what="the node's change")
        await cluster.patch_dlod(NS, "wan", {"spec": {"service": {"port": 8080}}})
        await cluster.wait(lambda: status_of(cluster).get("url", "").endswith(":8080"), timeout=10, what="the spec change")
        nodes_listed = [r for r in cluster.emulator if r.method.value == "GET" and r.resource is not None
                        and r.resource.plural in ("nodes", "pods") and r.params.get("watch") != "true"
                        and r.headers.get("User-Agent", "").startswith("dlo-operator")]
        assert nodes_listed == []  # the operator's own client lists neither: kopf's watches feed the indexes
