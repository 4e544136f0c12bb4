"""spec.lora.uri on the API emulator with the real operator, real fetch Jobs and a real store: the
adapters' folder (one adapter made by `dlo make-random-lora` against the tiny model) in moto's S3
server, fetched by `dlo fetch --kind lora` run as a local process (tests/operator/kubelet.py) onto
each node's own disk, as the model's uri is. The engine pods are placed only on nodes that hold it,
mount it read-only and get `--lora-dir` at it; a new `lora.uri` is fetched before the pods move to
it; a source that is not a folder of adapters is FetchFailed, naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster import dlodeployment
from dlo.delivery.uri import LORA_FOLDER
from dlo.operator import builders
from dlo.operator.names import FETCH_NODE_ANNOTATION, LORA_MOUNT, model_label
from test_model_delivery import (NS, URI, condition, delivery_cluster, failed_fetch, holders, key_of, profile,
                                 status_of)
from tests.delivery.conftest import files_of, start_moto, upload
from tests.engine.serving_helpers import tiny_pipeline

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
LORA_URI, LORA_URI_V2 = "s3://adapters/wan", "s3://adapters/wan-v2"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """moto with the tiny model under s3://models/tiny-wan and an adapters' folder (`style`) under
    s3://adapters/wan and s3://adapters/wan-v2."""
    server = start_moto()
    model = tiny_pipeline(tmp_path_factory)
    adapters = tmp_path_factory.mktemp("adapters")
    subprocess.run([sys.executable, "-m", "dlo.cli.main", "make-random-lora", str(model),
                    str(adapters / "style.safetensors"), "--rank", "4", "--no-progress"],
                   check=True, capture_output=True, cwd=ROOT)
    upload(server.client(), model, "models", "tiny-wan")
    for prefix in ("wan", "wan-v2"):
        upload(server.client(), adapters, "adapters", prefix)
    yield server, adapters
    server.process.terminate()
    server.process.wait(timeout=30)


def lora_spec(server, lora_uri: str, model: dict | None = None) -> dict:
    return {"model": model or {"path": "/models/tiny-wan"}, "replicas": 1, "devicesPerNode": 8, "mode": "allgather",
            "lora": {"uri": lora_uri, "endpoint": server.url, "secretRef": {"name": "store"}}}


def engine_pods(cluster) -> list[dict]:
    return [p for p in cluster.objects("Pod", NS)
            if (p["metadata"].get("labels") or {}).get(builders.COMPONENT) == "engine"]


def node_lora(cluster, node):
    return next((n.get("lora") or {} for n in status_of(cluster).get("nodes", []) if n["name"] == node), {})


def placed_only_where_held(cluster) -> None:
    """No engine pod is on a node that does not hold its adapters (checked at every poll)."""
    for pod in engine_pods(cluster):
        node, key = pod["spec"].get("nodeName"), pod["metadata"]["annotations"]["dlo.dev/lora-key"]
        if node:
            assert node in holders(cluster, key), f"pod {pod['metadata']['name']} on {node} before its adapters"


async def test_adapters_from_s3_are_fetched_onto_the_node_then_mounted_as_the_lora_dir(store, tmp_path):
    server, adapters = store
    model_key, key = key_of(URI, server.url), key_of(LORA_URI, server.url)
    cache = tmp_path / "cache"
    entry = {"bytes": 224288, "largest_block_bytes": 54016, "blocks": 3, "resident_ratio": 1.0}
    model = {"uri": URI, "endpoint": server.url, "secretRef": {"name": "store"}}
    async with delivery_cluster(server, tmp_path) as (cluster, kubelet):
        # node-1 holds the model (its profile lists it): the adapters go there first, one fetch
        await cluster.add_node("node-0", annotations=profile({}), allocatable={"nvidia.com/gpu": "8"})
        await cluster.add_node("node-1", annotations=profile({model_key: entry}),
                               allocatable={"nvidia.com/gpu": "8"})
        await cluster.create(dlodeployment("wan", NS, lora_spec(server, LORA_URI, model)))
        job = await cluster.wait(lambda: next(iter(cluster.objects("Job", NS)), None), what="a fetch Job")
        assert job["metadata"]["annotations"][FETCH_NODE_ANNOTATION] == "node-1"
        pod = job["spec"]["template"]["spec"]
        (fetch,) = pod["containers"]
        folder = f"/cache/{LORA_FOLDER}/{key}"
        assert fetch["command"][:4] == ["dlo", "fetch", LORA_URI, folder]
        assert fetch["command"][fetch["command"].index("--kind") + 1] == "lora"
        assert fetch["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
        assert job["spec"]["activeDeadlineSeconds"] > 0
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in fetch["env"] if "valueFrom" in e}
        assert refs["AWS_ACCESS_KEY_ID"] == "store"

        def ready():
            placed_only_where_held(cluster)
            return (condition(cluster, "Ready") or {}).get("status") == "True"

        await cluster.wait(ready, timeout=60, what="Ready with the adapters fetched")
        assert condition(cluster, "ModelReady")["reason"] == "Fetched"
        assert f"1 of 1 nodes hold the adapters {LORA_URI}" in condition(cluster, "ModelReady")["message"]
        assert node_lora(cluster, "node-1")["state"] == "complete"
        assert holders(cluster, key) == ["node-1"]
        assert files_of(kubelet.host_path("node-1", cache / LORA_FOLDER / key)) == files_of(adapters)
        (engine_pod,) = engine_pods(cluster)
        assert engine_pod["spec"]["nodeName"] == "node-1"
        (engine,) = engine_pod["spec"]["containers"]
        assert engine["command"][engine["command"].index("--lora-dir") + 1] == LORA_MOUNT
        assert {"name": "lora", "mountPath": LORA_MOUNT, "readOnly": True} in engine["volumeMounts"]
        assert {"name": "lora", "hostPath": {"path": f"{cache}/{LORA_FOLDER}/{key}", "type": "Directory"}} \
            in engine_pod["spec"]["volumes"]
        terms = engine_pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert {"key": model_label(key), "operator": "Exists"} in terms["nodeSelectorTerms"][0]["matchExpressions"]
        assert [e for e in cluster.events("FetchStarted") if "the adapters" in e["message"]]


async def test_new_adapters_are_fetched_before_the_pods_move_to_them(store, tmp_path):
    server, adapters = store
    old, new = key_of(LORA_URI, server.url), key_of(LORA_URI_V2, server.url)
    cache = tmp_path / "cache"
    async with delivery_cluster(server, tmp_path) as (cluster, kubelet):
        await cluster.add_node("node-0", labels={model_label(old): "true"}, allocatable={"nvidia.com/gpu": "8"})
        await cluster.create(dlodeployment("wan", NS, lora_spec(server, LORA_URI)))
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
        (before,) = engine_pods(cluster)
        await cluster.patch_dlod(NS, "wan", {"spec": {"lora": {"uri": LORA_URI_V2}}})
        await cluster.wait(lambda: condition(cluster, "Progressing").get("reason") == "Fetching", what="fetching")
        assert f"the adapters {LORA_URI_V2}" in condition(cluster, "Progressing")["message"]
        template = cluster.get("StatefulSet", NS, "wan")["spec"]["template"]["metadata"]["annotations"]
        assert template["dlo.dev/lora-key"] == old  # the pods keep their adapters meanwhile

        def moved():
            placed_only_where_held(cluster)
            pods = engine_pods(cluster)
            return len(pods) == 1 and pods[0]["metadata"]["annotations"].get("dlo.dev/lora-key") == new \
                and pods[0]["spec"].get("nodeName")

        await cluster.wait(moved, timeout=60, what="the pod on the new adapters")
        assert engine_pods(cluster)[0]["metadata"]["uid"] != before["metadata"]["uid"]
        assert files_of(kubelet.host_path("node-0", cache / LORA_FOLDER / new)) == files_of(adapters)


async def test_a_source_without_adapters_is_fetch_failed_naming_the_adapters(store, tmp_path):
    server, _ = store
    server.client().put_object(Bucket="adapters", Key="readme-only/README.md", Body=b"adapters elsewhere")
    uri = "s3://adapters/readme-only"
    async with failed_fetch(server, tmp_path, lora_spec(server, uri)) as (cluster, _):
        failed = node_lora(cluster, "node-0")
        assert failed["state"] == "failed" and failed["reason"] == "refused", failed
        assert "not a folder of LoRA adapters" in failed["message"]
        message = condition(cluster, "ModelReady")["message"]
        assert f"the adapters {uri}" in message and "node-0: refused" in message
        assert condition(cluster, "Ready")["reason"] == "FetchFailed"
        assert not [p for p in engine_pods(cluster) if p["spec"].get("nodeName")]
