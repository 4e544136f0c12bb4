"""End to end: examples/dlodeployment.yaml -> operator -> StatefulSet -> local processes -> an image.

The resource is applied to the API emulator (pointed at a tiny model made here, `engine.device:
cpu`); the operator (kopf, its own thread) reconciles; the emulated StatefulSet controller creates
the pod; a local kubelet runs the pod's `dlo warm` init container and its `dlo serve` container as
processes; a request to the client Service's port returns a PNG. Deleting the resource removes
every child (owner references + the emulated garbage collector) and stops the processes.
"""

import asyncio
import base64
import socket
import struct
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from cluster import running_cluster
from dlo.operator.models import API_VERSION, KIND
from kubelet import LocalKubelet

ROOT = Path(__file__).resolve().parents[2]
NS = "default"
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny-wan"
    subprocess.run([sys.executable, "-m", "dlo.cli.main", "make-tiny-model", str(out), "--family", "wan"],
                   check=True, capture_output=True, cwd=ROOT)
    return out


def example(model: Path, port: int) -> tuple[dict, dict]:
    docs = [d for d in yaml.safe_load_all((ROOT / "examples" / "dlodeployment.yaml").read_text()) if d]
    secret = next(d for d in docs if d["kind"] == "Secret")
    res = next(d for d in docs if d["kind"] == KIND)
    spec = res["spec"]
    spec["model"]["path"] = str(model)
    spec["replicas"] = 1
    spec["devicesPerNode"] = 2
    spec["engine"]["device"] = "cpu"
    # A stalled rank fails the request with 503 within a minute instead of hanging the test.
    spec["engine"]["args"] = ["--small-limits", "--progress-timeout", "60"]
    spec["service"]["port"] = port
    for obj in (secret, res):
        obj["metadata"]["namespace"] = NS
    return secret, res


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:16]
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def condition(cluster, type_):
    obj = cluster.get(KIND, NS, "wan") or {}
    return next((c for c in (obj.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


async def test_custom_resource_to_served_image_and_back(tiny_model, tmp_path):
    port = free_port()
    secret, res = example(tiny_model, port)
    async with running_cluster(ready_when=lambda pod: False) as cluster:  # readiness: the kubelet's probe
        kubelet = LocalKubelet(cluster, tmp_path)
        kubelet_task = asyncio.create_task(kubelet.run())
        try:
            await cluster.create(secret)
            await cluster.create(res)

            def ready():
                assert not kubelet.failures, (kubelet.failures, kubelet.logs("wan-0"))
                return condition(cluster, "Ready").get("status") == "True"

            await cluster.wait(ready, timeout=150, what="DLODeployment Ready (pod warmed, engine ready)")
            status = cluster.get(KIND, NS, "wan")["status"]
            assert status["mode"] == "allgather" and status["readyReplicas"] == 1
            assert "wan-0.warm" in " ".join(p.name for p in tmp_path.glob("*.log"))

            service = cluster.get("Service", NS, "wan")
            assert service["metadata"]["labels"]["dlo.dev/service"] == "client"
            svc_port = service["spec"]["ports"][0]["port"]
            key = secret["stringData"]["api-key"]
            body = {"model": "tiny-wan", "prompt": "a lighthouse at dawn", "size": "64x64",
                    "num_inference_steps": 2, "seed": 7}
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
                auth = {"Authorization": f"Bearer {key}"}
                async with session.get(f"http://127.0.0.1:{svc_port}/v1/models", headers=auth) as resp:
                    assert [m["id"] for m in (await resp.json())["data"]] == ["tiny-wan"]  # the folder's name
                url = f"http://127.0.0.1:{svc_port}/v1/images/generations"
                async with session.post(url, json=body) as resp:
                    assert resp.status == 401  # the key from the Secret is required
                async with session.post(url, json=body, headers=auth) as resp:
                    assert resp.status == 200, await resp.text()
                    payload = await resp.json()
            assert png_size(base64.b64decode(payload["data"][0]["b64_json"])) == (64, 64)

            processes = [p for procs in kubelet.processes.values() for p in procs]
            assert await cluster.delete_dlod(NS, "wan")
            await cluster.wait(
                lambda: not any(cluster.objects(k, NS) for k in ("StatefulSet", "Service", "PodDisruptionBudget", "Pod")),
                timeout=30, what="children garbage-collected",
            )
            await cluster.wait(lambda: all(p.returncode is not None for p in processes), timeout=40,
                               what="engine processes stopped")
            assert cluster.get(KIND, NS, "wan", API_VERSION) is None
        except BaseException:
            # Shown with the failure: what the pod printed, what the kubelet saw, what the operator did.
            print(f"---- pod wan-0 logs ----\n{kubelet.logs('wan-0')[-8000:]}")
            print(f"---- kubelet failures: {kubelet.failures}; pods: {[p['metadata']['uid'] for p in cluster.objects('Pod', NS)]}")
            print(f"---- events: {[(e['reason'], e['message']) for e in cluster.events_all()]}")
            raise
        finally:
            await kubelet.stop()
            kubelet_task.cancel()
            await asyncio.gather(kubelet_task, return_exceptions=True)
