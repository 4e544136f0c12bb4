"""spec.model.uri on the API emulator with the real operator, real fetch Jobs and a real store: the
fetch Jobs' pods run `dlo fetch` as local processes (tests/operator/kubelet.py) against moto's S3
server with the real boto3 client, each node on a disk of its own (as in a cluster: two nodes'
fetches of one model never share a staging folder). Placement from two node profiles (one lists the
model, one does not), the fetch request, the status while fetching, and the roll to a new model
(fetched first)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest

from cluster import dlodeployment, running_cluster
from dlo.delivery.uri import cache_key, parse_uri
from dlo.operator import builders
from dlo.operator.names import FETCH_NODE_ANNOTATION, model_label
from kubelet import LocalKubelet
from tests.delivery.conftest import files_of, start_moto, upload
from tests.engine.serving_helpers import tiny_pipeline

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
NS = "serving"
URI, URI_V2 = "s3://models/tiny-wan", "s3://models/tiny-wan-v2"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    server = start_moto()
    model = tiny_pipeline(tmp_path_factory)
    upload(server.client(), model, "models", "tiny-wan")
    upload(server.client(), model, "models", "tiny-wan-v2")
    yield server, model
    server.process.terminate()
    server.process.wait(timeout=30)


def key_of(uri: str, endpoint: str) -> str:
    return cache_key(parse_uri(uri), endpoint)


def profile(models: dict) -> dict[str, str]:
    data = json.loads((ROOT / "examples" / "profiles" / "h200-node.json").read_text())
    data["models"] = models
    return {"dlo.dev/node-profile": json.dumps(data)}


def spec_for(uri: str, endpoint: str) -> dict:
    return {"model": {"uri": uri, "endpoint": endpoint, "secretRef": {"name": "store"}}, "replicas": 2,
            "devicesPerNode": 8, "mode": "allgather"}


def fetch_pods(pod: dict) -> bool:
    return (pod["metadata"].get("labels") or {}).get(builders.COMPONENT) == "fetch"


async def start(cluster, server, tmp_path):
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "store", "namespace": NS},
              "stringData": {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}}
    await cluster.create(secret)
    kubelet = LocalKubelet(cluster, tmp_path / "kubelet", select=fetch_pods, node_disks=True)
    kubelet.workdir.mkdir()
    return kubelet, asyncio.create_task(kubelet.run())


def status_of(cluster, name="wan"):
    return ((cluster.get("DLODeployment", NS, name) or {}).get("status")) or {}


def condition(cluster, type_):
    return next((c for c in status_of(cluster).get("conditions", []) if c["type"] == type_), {})


def node_model(cluster, node):
    return next((n.get("model") or {} for n in status_of(cluster).get("nodes", []) if n["name"] == node), {})


def holders(cluster, key):
    return sorted(n["metadata"]["name"] for n in cluster.objects("Node")
                  if (n["metadata"].get("labels") or {}).get(model_label(key)) == "true")


async def test_placement_from_two_profiles_a_fetch_job_and_the_status_while_fetching(store, tmp_path):
    server, model = store
    key = key_of(URI, server.url)
    cache = tmp_path / "cache"
    entry = {"bytes": 224288, "largest_block_bytes": 54016, "blocks": 3, "resident_ratio": 1.0}
    async with running_cluster(cache_root=str(cache)) as cluster:
        kubelet, task = await start(cluster, server, tmp_path)
        try:
            await cluster.add_node("node-0", annotations=profile({key: entry}), allocatable={"nvidia.com/gpu": "8"})
            await cluster.add_node("node-1", annotations=profile({}), allocatable={"nvidia.com/gpu": "8"})
            await cluster.create(dlodeployment("wan", NS, spec_for(URI, server.url)))
            # node-0's profile lists the folder: labelled, no fetch; node-1 gets a fetch Job
            job = await cluster.wait(lambda: next(iter(cluster.objects("Job", NS)), None), what="a fetch Job")
            assert job["metadata"]["annotations"][FETCH_NODE_ANNOTATION] == "node-1"
            pod = job["spec"]["template"]["spec"]
            terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-1"]}]}]
            (fetch,) = pod["containers"]
            assert fetch["command"][:4] == ["dlo", "fetch", URI, f"/cache/{key}"]
            refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in fetch["env"] if "valueFrom" in e}
            assert refs["AWS_ACCESS_KEY_ID"] == refs["AWS_SECRET_ACCESS_KEY"] == "store"
            assert not [e for e in fetch["env"] if e.get("value") == server.secret_key]
            assert pod["volumes"][0]["hostPath"] == {"path": str(cache), "type": "DirectoryOrCreate"}
            assert holders(cluster, key) == ["node-0"]
            sts = await cluster.wait(lambda: cluster.get("StatefulSet", NS, "wan"), what="the StatefulSet")
            engine_pod = sts["spec"]["template"]["spec"]
            required = engine_pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
            assert required["nodeSelectorTerms"] == [{"matchExpressions": [{"key": model_label(key), "operator": "Exists"}]}]
            assert engine_pod["volumes"][0]["hostPath"] == {"path": f"{cache}/{key}", "type": "Directory"}
            # while node-1 fetches: ModelReady False (Fetching), the node's fetch in status.nodes
            await cluster.wait(lambda: condition(cluster, "ModelReady").get("reason") == "Fetching", what="Fetching")
            assert "1/2 nodes hold" in condition(cluster, "ModelReady")["message"]
            assert node_model(cluster, "node-0") == {"state": "complete"}
            assert node_model(cluster, "node-1")["state"] in ("fetching", "complete")
            await cluster.wait(lambda: condition(cluster, "ModelReady").get("status") == "True", timeout=60,
                               what="fetched")
            assert condition(cluster, "ModelReady")["reason"] == "Fetched"
            assert holders(cluster, key) == ["node-0", "node-1"]
            assert files_of(kubelet.host_path("node-1", cache / key)) == files_of(model)
            await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
            placed = sorted(p["spec"]["nodeName"] for p in cluster.objects("Pod", NS) if not fetch_pods(p))
            assert placed == ["node-0", "node-1"]
            await cluster.wait(lambda: not cluster.objects("Job", NS), what="the finished Job removed")
            assert cluster.events("FetchStarted") and cluster.events("ModelFetched")
        finally:
            await kubelet.stop()
            task.cancel()


async def test_a_new_uri_is_fetched_before_the_pods_move_to_it(store, tmp_path):
    server, model = store
    old, new = key_of(URI, server.url), key_of(URI_V2, server.url)
    cache = tmp_path / "cache"
    async with running_cluster(cache_root=str(cache)) as cluster:
        kubelet, task = await start(cluster, server, tmp_path)
        try:
            for i in range(2):
                await cluster.add_node(f"node-{i}", labels={model_label(old): "true"}, allocatable={"nvidia.com/gpu": "8"})
            await cluster.create(dlodeployment("wan", NS, spec_for(URI, server.url)))
            await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
            pods = {p["metadata"]["name"]: p["metadata"]["uid"] for p in cluster.objects("Pod", NS)}
            await cluster.patch_dlod(NS, "wan", {"spec": {"model": {"uri": URI_V2}}})
            await cluster.wait(lambda: condition(cluster, "Progressing").get("reason") == "Fetching", what="fetching first")
            assert "before the pods move to it" in condition(cluster, "Progressing")["message"]
            template = cluster.get("StatefulSet", NS, "wan")["spec"]["template"]["metadata"]["annotations"]
            assert template["dlo.dev/model-key"] == old  # the pods keep their model meanwhile

            def moved():
                engine = [p for p in cluster.objects("Pod", NS) if not fetch_pods(p)]
                return len(engine) == 2 and all(p["metadata"]["annotations"].get("dlo.dev/model-key") == new
                                                and p["spec"].get("nodeName") for p in engine)

            await cluster.wait(moved, timeout=90, what="pods on the new model")
            assert holders(cluster, new) == ["node-0", "node-1"]
            for node in ("node-0", "node-1"):  # each node fetched it onto its own disk
                assert files_of(kubelet.host_path(node, cache / new)) == files_of(model)
            for p in cluster.objects("Pod", NS):
                assert p["metadata"]["uid"] not in pods.values()  # each pod was replaced once, after the fetch
            await cluster.wait(lambda: condition(cluster, "ModelReady").get("reason") == "Fetched"
                               and (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready on v2")
        finally:
            await kubelet.stop()
            task.cancel()


@contextlib.asynccontextmanager
async def delivery_cluster(server, tmp_path, **overrides):
    """The emulated cluster with the operator (its cache root `tmp_path/cache`) and a kubelet that runs
    the fetch pods, each node on a disk of its own: the cluster and the kubelet."""
    async with running_cluster(cache_root=str(tmp_path / "cache"), **overrides) as cluster:
        kubelet, task = await start(cluster, server, tmp_path)
        try:
            yield cluster, kubelet
        finally:
            await kubelet.stop()
            task.cancel()


@contextlib.asynccontextmanager
async def failed_fetch(server, tmp_path, spec: dict):
    """One node, a DLODeployment of `spec` whose fetch failed (ModelReady FetchFailed, no retry for
    300 s): the cluster and the kubelet."""
    async with delivery_cluster(server, tmp_path, fetch_retry_seconds=300) as (cluster, kubelet):
        await cluster.add_node("node-0", allocatable={"nvidia.com/gpu": "8"})
        await cluster.create(dlodeployment("wan", NS, spec))
        await cluster.wait(lambda: condition(cluster, "ModelReady").get("reason") == "FetchFailed", timeout=60,
                           what="FetchFailed")
        yield cluster, kubelet


async def test_a_source_that_is_not_a_pipeline_fails_the_fetch_with_its_reason(store, tmp_path):
    server, _ = store
    server.client().put_object(Bucket="models", Key="not-a-pipeline/readme.txt", Body=b"weights elsewhere")
    uri = "s3://models/not-a-pipeline"
    async with failed_fetch(server, tmp_path, {**spec_for(uri, server.url), "replicas": 1}) as (cluster, kubelet):
        failed = node_model(cluster, "node-0")
        assert failed["state"] == "failed" and failed["reason"] == "refused", failed
        assert "no model_index.json" in failed["message"]
        assert "node-0: refused" in condition(cluster, "ModelReady")["message"]
        assert condition(cluster, "Ready")["reason"] == "FetchFailed"
        # exit 2 fails the Job at once (podFailurePolicy): one pod, no retries
        assert len([p for p in cluster.objects("Pod", NS) if fetch_pods(p)]) == 1
        assert not kubelet.host_path("node-0", tmp_path / "cache" / key_of(uri, server.url)).exists()
