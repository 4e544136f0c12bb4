"""End to end, cluster operations: the example resource (tiny model, 2 CPU ranks per pod, 2 replicas)
on the API emulator with the operator, the scheduler, the StatefulSet controller and the local
kubelet running the pods' processes. Checked: no engine pod is BestEffort (every container asks
for CPU and memory), a KEDA ScaledObject on the scale subresource (KEDA's CRD is declared), the
status reasons Warming (the warmer running), ImagePullBackOff, FailedMount and Unschedulable, each
naming the pod and the kubelet's or scheduler's words, and a scale-in through the scale
subresource (as an autoscaler does) after which a finished video survives on the shared claim.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import kmock
import pytest
import pytest_asyncio

from cluster import dlodeployment, running_cluster
from dlo.operator.kube import _path
from dlo.operator.models import API_VERSION, KIND
from kubelet import LocalKubelet
from test_operator_e2e import example, free_port, tiny_model  # noqa: F401  (the module's model fixture)

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
NS = "default"
UNPULLABLE = "registry.invalid/dlo:missing"


def conditions(cluster, name: str) -> dict[str, dict]:
    obj = cluster.get(KIND, NS, name) or {}
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions", [])}


def qos_class(pod: dict) -> str:
    """The pod's QoS class as Kubernetes computes it (kubectl describe pod: QoS Class)."""
    containers = pod["spec"]["containers"] + pod["spec"].get("initContainers", [])
    requests = [c.get("resources", {}).get("requests", {}) for c in containers]
    limits = [c.get("resources", {}).get("limits", {}) for c in containers]
    if not any(r.get("cpu") or r.get("memory") for r in requests) and not any(
            lim.get("cpu") or lim.get("memory") for lim in limits):
        return "BestEffort"
    guaranteed = all(r.get(k) and r.get(k) == lim.get(k) for r, lim in zip(requests, limits) for k in ("cpu", "memory"))
    return "Guaranteed" if guaranteed else "Burstable"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ops(tiny_model, tmp_path_factory):  # noqa: F811
    """The cluster with `wan` ready (2 pods), three broken resources, and what was seen meanwhile."""
    tmp = tmp_path_factory.mktemp("ops")
    secret, res = example(tiny_model, free_port())
    spec = res["spec"]
    spec["videos"] = {"claimName": "videos"}
    spec["autoscaling"] = {"enabled": True, "minReplicas": 1, "maxReplicas": 2, "targetQueueDepthPerRank": 1.5}
    spec["engine"].pop("resources")  # the operator's own requests (the example sets its own)
    async with running_cluster(ready_when=lambda pod: False) as cluster:
        cluster.emulator.resources["keda.sh/v1alpha1/scaledobjects"] = kmock.ResourceInfo(
            kind="ScaledObject", singular="scaledobject", namespaced=True,
            verbs={"get", "list", "watch", "create", "patch", "delete"})
        kubelet = LocalKubelet(cluster, tmp)
        kubelet.unpullable.add(UNPULLABLE)
        task = asyncio.create_task(kubelet.run())
        seen: dict[str, set[tuple[str, str]]] = {}

        async def record() -> None:  # every (condition, reason) each resource went through
            while True:
                for name in ("wan", "pull", "mount", "unsched"):
                    for c in conditions(cluster, name).values():
                        seen.setdefault(name, set()).add((c["type"], c["reason"]))
                await asyncio.sleep(0.05)

        recorder = asyncio.create_task(record())
        try:
            for i in range(2):
                await cluster.add_node(f"node-{i}", labels=spec["placement"]["nodeSelector"],
                                       allocatable={"cpu": "2", "memory": "8Gi"})
            await cluster.create(secret)
            await cluster.create(res)
            small = {"model": {"path": str(tiny_model)}, "engine": {"device": "cpu"}, "mode": "rank-local"}
            await cluster.create(dlodeployment("pull", NS, {**small, "warmer": {"image": UNPULLABLE}}))
            await cluster.create(dlodeployment("mount", NS, {**small, "model": {"path": str(tmp / "no-such-model")}}))
            await cluster.create(dlodeployment("unsched", NS, {**small, "placement": {"nodeSelector": {"pool": "none"}}}))

            def ready() -> bool:
                assert not kubelet.failures, kubelet.failures
                status = (cluster.get(KIND, NS, "wan") or {}).get("status") or {}
                return conditions(cluster, "wan").get("Ready", {}).get("status") == "True" and status.get(
                    "readyReplicas") == 2

            await cluster.wait(ready, timeout=240, what="wan Ready")
            yield {"cluster": cluster, "kubelet": kubelet, "seen": seen, "tmp": tmp, "state": {}}
        finally:
            recorder.cancel()
            await kubelet.stop()
            task.cancel()
            await asyncio.gather(task, recorder, return_exceptions=True)


async def test_engine_pods_are_never_best_effort(ops):
    pods = [p for p in ops["cluster"].objects("Pod", NS) if p["metadata"]["labels"]["app.kubernetes.io/instance"] == "wan"]
    assert len(pods) == 2
    for pod in pods:
        assert qos_class(pod) == "Burstable", pod["metadata"]["name"]
        for c in pod["spec"]["containers"] + pod["spec"].get("initContainers", []):
            requests = c["resources"]["requests"]
            assert requests.get("cpu") and requests.get("memory"), (pod["metadata"]["name"], c["name"])
        (engine,) = pod["spec"]["containers"]
        assert engine["resources"]["requests"]["cpu"] == "2"  # one CPU per rank


async def test_a_keda_scaled_object_targets_the_scale_subresource(ops):
    cluster = ops["cluster"]
    scaled = await cluster.wait(lambda: cluster.get("ScaledObject", NS, "wan"), what="the ScaledObject")
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": API_VERSION, "kind": KIND, "name": "wan"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 2)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metadata"]["threshold"] == "3"  # 1.5 per rank x 2 ranks
    assert 'dlo_queue_depth{namespace="default",deployment="wan"}' in trigger["metadata"]["query"]
    assert 'dlo_requests_running{namespace="default",deployment="wan"}' in trigger["metadata"]["query"]
    assert cluster.get("HorizontalPodAutoscaler", NS, "wan") is None
    assert cluster.get(KIND, NS, "wan")["status"]["autoscaler"] == "ScaledObject"


async def test_each_new_status_reason_names_the_pod_and_the_kubelets_words(ops):
    cluster = ops["cluster"]
    assert ("Ready", "Warming") in ops["seen"]["wan"], ops["seen"]["wan"]
    expected = {
        "pull": ("ImagePullBackOff", f'pod pull-0: container warm: ImagePullBackOff: Back-off pulling image "{UNPULLABLE}"'),
        "mount": ("FailedMount", "pod mount-0: FailedMount: MountVolume.SetUp failed"),
        "unsched": ("Unschedulable", "pod unsched-0: 0/2 nodes are available: 2 node(s) didn't match Pod's node "
                                     "affinity/selector."),
    }
    for name, (reason, words) in expected.items():
        await cluster.wait(lambda: conditions(cluster, name).get("Ready", {}).get("reason") == reason,
                           what=f"{name}: Ready reason {reason}")
        ready = conditions(cluster, name)["Ready"]
        assert ready["status"] == "False" and words in ready["message"], (name, ready)
        assert conditions(cluster, name)["Progressing"]["reason"] == reason


async def test_scale_in_through_the_scale_subresource_keeps_finished_videos_on_the_claim(ops):
    cluster, kubelet = ops["cluster"], ops["kubelet"]
    auth = {"Authorization": "Bearer change-me"}
    body = {"prompt": "waves", "size": "64x64", "num_frames": 5, "num_inference_steps": 2, "seed": 3}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(f"{kubelet.pod_url('wan-1')}/v1/videos", json=body, headers=auth) as resp:
            assert resp.status == 200, await resp.text()
            job = await resp.json()
        deadline = time.monotonic() + 120
        while job["status"] not in ("completed", "failed"):
            assert time.monotonic() < deadline, job
            await asyncio.sleep(0.2)
            async with session.get(f"{kubelet.pod_url('wan-1')}/v1/videos/{job['id']}", headers=auth) as resp:
                job = await resp.json()
    assert job["status"] == "completed", job
    processes = list(kubelet.processes.get(cluster.get("Pod", NS, "wan-1")["metadata"]["uid"], []))
    # as an autoscaler does: PATCH the scale subresource
    async with cluster.emulator.request("PATCH", _path(API_VERSION, KIND, NS, "wan") + "/scale",
                                        json={"spec": {"replicas": 1}},
                                        headers={"Content-Type": "application/merge-patch+json"}) as resp:
        assert resp.status == 200, await resp.text()
    await cluster.wait(lambda: cluster.get("StatefulSet", NS, "wan")["spec"]["replicas"] == 1, what="sts scaled in")
    await cluster.wait(lambda: cluster.get("Pod", NS, "wan-1") is None, what="wan-1 removed")
    await cluster.wait(lambda: all(p.returncode is not None for p in processes), timeout=60, what="wan-1 drained")
    assert [p.returncode for p in processes][-1] == 0  # the engine drained and exited 0 on SIGTERM
    claim = ops["tmp"] / "pvc-videos"
    assert any(p.suffix == ".mp4" for p in claim.rglob("*")), sorted(claim.rglob("*"))  # the video outlived its pod
    await cluster.wait(lambda: (cluster.get(KIND, NS, "wan")["status"] or {}).get("readyReplicas") == 1
                       and conditions(cluster, "wan")["Ready"]["status"] == "True", what="Ready with one pod")
    ops["state"]["job"] = job["id"]


async def test_the_remaining_pod_answers_a_poll_for_the_removed_pods_finished_video(ops):
    kubelet, job = ops["kubelet"], ops["state"]["job"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        async with session.get(f"{kubelet.pod_url('wan-0')}/v1/videos/{job}",
                               headers={"Authorization": "Bearer change-me"}) as resp:
            assert resp.status == 200, (resp.status, await resp.text())
            assert (await resp.json())["status"] == "completed"
