"""End to end, `spec.lora` and `spec.pod`: the tiny model served by three DLODeployments, one with its
LoRA adapters on a claim (`lora.claimName` + `subPath`), one on a node folder (`lora.path`), one at a
URI in moto's S3 server (`lora.uri`: its fetch Job's pod run by the kubelet too), each with pod
labels, annotations and an extra volume; the local kubelet runs `dlo serve --lora-dir /lora` and a
request naming an adapter is answered with an image through the Service."""

from __future__ import annotations

import base64
import copy
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from cluster import running_cluster
from dlo.delivery.uri import LORA_FOLDER, cache_key, parse_uri
from dlo.operator.models import KIND
from kubelet import running_kubelet
from tests.delivery.conftest import start_moto, upload
from test_operator_e2e import NS, ROOT, example, free_port, png_size, tiny_model  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow
POD = {"labels": {"kueue.x-k8s.io/queue-name": "gpu"}, "annotations": {"sidecar.istio.io/inject": "false"},
       "volumes": [{"name": "scratch", "emptyDir": {}}], "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}]}


def random_lora(model: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "dlo.cli.main", "make-random-lora", str(model), str(out), "--rank", "4",
                    "--no-progress"], check=True, capture_output=True, cwd=ROOT)


def resource(model: Path, name: str, port: int, lora: dict) -> tuple[dict, dict]:
    secret, res = example(model, port)
    res = copy.deepcopy(res)
    res["metadata"]["name"] = name
    res["spec"].update(replicas=1, lora=lora, pod=POD)
    res["spec"]["engine"].pop("resources")
    return secret, res


async def generate(port: int, key: str, lora: str) -> tuple[int, dict]:
    body = {"model": "tiny-wan", "prompt": "a lighthouse", "size": "64x64", "num_inference_steps": 2, "seed": 1,
            "lora": lora}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(f"http://127.0.0.1:{port}/v1/images/generations", json=body,
                                headers={"Authorization": f"Bearer {key}"}) as resp:
            return resp.status, await resp.json()


@pytest.fixture
def store(tiny_model, tmp_path):
    """moto's S3 server holding an adapter (`tide`) under s3://adapters/wan, and the Secret of its keys."""
    server = start_moto()
    random_lora(tiny_model, tmp_path / "s3-adapters" / "tide.safetensors")
    upload(server.client(), tmp_path / "s3-adapters", "adapters", "wan")
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "store", "namespace": NS},
              "stringData": {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key}}
    yield server, secret
    server.process.terminate()
    server.process.wait(timeout=30)


async def test_adapters_from_a_claim_a_node_folder_and_a_uri_reach_dlo_serve(tiny_model, store, tmp_path):
    server, store_secret = store
    kubelet_dir = tmp_path / "kubelet"
    kubelet_dir.mkdir()
    random_lora(tiny_model, kubelet_dir / "pvc-adapters" / "wan" / "style.safetensors")  # the claim's files
    random_lora(tiny_model, tmp_path / "node-lora" / "ink")  # a folder adapter on the node
    ports = {"wan-claim": free_port(), "wan-path": free_port(), "wan-uri": free_port()}
    secret, claim = resource(tiny_model, "wan-claim", ports["wan-claim"], {"claimName": "adapters", "subPath": "wan"})
    _, path = resource(tiny_model, "wan-path", ports["wan-path"], {"path": str(tmp_path / "node-lora")})
    lora_uri = {"uri": "s3://adapters/wan", "endpoint": server.url, "secretRef": {"name": "store"}}
    _, uri = resource(tiny_model, "wan-uri", ports["wan-uri"], lora_uri)
    cache = tmp_path / "cache"
    async with running_cluster(ready_when=lambda pod: False, cache_root=str(cache)) as cluster, \
            running_kubelet(cluster, kubelet_dir) as kubelet:
        try:
            await cluster.add_node("node-0", labels=claim["spec"]["placement"]["nodeSelector"],
                                   allocatable={"cpu": "4", "memory": "16Gi"})
            for obj in (secret, store_secret, claim, path, uri):
                await cluster.create(obj)

            def ready() -> bool:
                assert not kubelet.failures, (kubelet.failures, kubelet.logs("wan-claim-0"), kubelet.logs("wan-path-0"))
                return all((cluster.get(KIND, NS, n) or {}).get("status", {}).get("readyReplicas") == 1 for n in ports)

            await cluster.wait(ready, timeout=240, what="the three DLODeployments ready")
            pod = cluster.get("Pod", NS, "wan-claim-0")
            assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu"
            assert pod["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
            (engine,) = pod["spec"]["containers"]
            assert engine["command"][engine["command"].index("--lora-dir") + 1] == "/lora"
            assert {"name": "scratch", "mountPath": "/scratch"} in engine["volumeMounts"]
            key = secret["stringData"]["api-key"]
            lora_key = cache_key(parse_uri(lora_uri["uri"]), server.url)  # the adapters' folder in the node cache
            assert {"name": "lora", "hostPath": {"path": f"{cache}/{LORA_FOLDER}/{lora_key}", "type": "Directory"}} \
                in cluster.get("Pod", NS, "wan-uri-0")["spec"]["volumes"]
            for name, adapter in (("wan-claim", "style"), ("wan-path", "ink"), ("wan-uri", "tide")):
                status, payload = await generate(ports[name], key, adapter)
                assert status == 200, payload
                assert png_size(base64.b64decode(payload["data"][0]["b64_json"])) == (64, 64)
            status, payload = await generate(ports["wan-claim"], key, "ink")  # the other deployment's adapter
            assert status == 400 and "style" in str(payload), payload
        except BaseException:
            for name in ports:
                print(f"---- pod {name}-0 logs ----\n{kubelet.logs(f'{name}-0')[-6000:]}")
            print(f"---- events: {[(e['reason'], e['message']) for e in cluster.events_all()]}")
            raise
