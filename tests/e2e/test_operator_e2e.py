"""End to end: examples/dlodeployment.yaml -> operator -> StatefulSet -> local processes -> an image.

The resource is applied to the API emulator (pointed at a tiny model made here, `engine.device:
cpu`, 2 replicas); the operator (kopf, its own thread) reconciles; the emulated StatefulSet
controller creates the pods; a local kubelet runs each pod's `dlo warm` init container and its
`dlo serve` container as processes; a request to the client Service's port returns a PNG. A video
job created on one pod is polled, downloaded and deleted through the other (it forwards through
the headless Service's names) and through the client Service. Deleting the resource removes every
child (owner references + the emulated garbage collector) and stops the processes.
"""

import asyncio
import base64
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

from cluster import running_cluster
from dlo.operator.models import API_VERSION, KIND
from kubelet import LocalKubelet

ROOT = Path(__file__).resolve().parents[2]
NS = "default"
REPLICAS = 2
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
    spec["replicas"] = REPLICAS
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


async def video_job_answered_by_any_pod(kubelet, service_url: str, auth: dict[str, str]) -> None:
    """A job made on wan-0 is polled, downloaded and deleted through wan-1 (which forwards to wan-0
    through the headless Service's names) and polled through the client Service (either pod)."""
    wan0, wan1 = kubelet.pod_url("wan-0"), kubelet.pod_url("wan-1")
    body = {"prompt": "waves", "size": "64x64", "num_frames": 5, "num_inference_steps": 2, "seed": 3}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.post(f"{wan0}/v1/videos", json=body, headers=auth) as resp:
            assert resp.status == 200, await resp.text()
            job = await resp.json()
        assert job["id"].startswith("video_wan-0_"), job
        deadline = time.monotonic() + 120
        while True:
            async with session.get(f"{wan1}/v1/videos/{job['id']}", headers=auth) as resp:
                assert resp.status == 200, await resp.text()
                job = await resp.json()
            if job["status"] in ("completed", "failed"):
                break
            assert time.monotonic() < deadline, f"video still {job['status']}"
            await asyncio.sleep(0.1)
        assert job["status"] == "completed" and job["expires_at"] == job["completed_at"] + 3600, job
        contents = []
        for base in (wan0, wan1):
            async with session.get(f"{base}/v1/videos/{job['id']}/content", headers=auth) as resp:
                assert resp.status == 200 and resp.headers["content-type"] == "video/mp4"
                contents.append(await resp.read())
        assert contents[0] == contents[1] and contents[0][4:8] == b"ftyp"
    for _ in range(2 * REPLICAS):  # a new connection each time: the Service spreads them over the pods
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
            async with session.get(f"{service_url}/v1/videos/{job['id']}", headers=auth) as resp:
                assert resp.status == 200 and (await resp.json())["status"] == "completed"
    async with aiohttp.ClientSession() as session:
        async with session.delete(f"{wan1}/v1/videos/{job['id']}", headers=auth) as resp:
            assert resp.status == 200 and (await resp.json()) == {"id": job["id"], "object": "video.deleted",
                                                                   "deleted": True}
        async with session.get(f"{wan0}/v1/videos/{job['id']}", headers=auth) as resp:
            assert resp.status == 404


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
            for i in range(REPLICAS):
                await cluster.add_node(f"node-{i}", labels=res["spec"]["placement"]["nodeSelector"],
                                       allocatable={"cpu": "2", "memory": "8Gi"})
            await cluster.create(secret)
            await cluster.create(res)

            def ready():
                assert not kubelet.failures, (kubelet.failures, kubelet.logs("wan-0"), kubelet.logs("wan-1"))
                status = (cluster.get(KIND, NS, "wan") or {}).get("status") or {}
                return condition(cluster, "Ready").get("status") == "True" and status.get("readyReplicas") == REPLICAS

            await cluster.wait(ready, timeout=240, what="DLODeployment Ready (pods warmed, engines ready)")
            status = cluster.get(KIND, NS, "wan")["status"]
            assert status["mode"] == "allgather" and status["readyReplicas"] == REPLICAS
            assert {"wan-0.warm.log", "wan-1.warm.log"} <= {p.name for p in tmp_path.glob("*.log")}

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
            await video_job_answered_by_any_pod(kubelet, f"http://127.0.0.1:{svc_port}", auth)

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
            for pod in ("wan-0", "wan-1"):
                print(f"---- pod {pod} logs ----\n{kubelet.logs(pod)[-8000:]}")
            print(f"---- kubelet failures: {kubelet.failures}; pods: {[p['metadata']['uid'] for p in cluster.objects('Pod', NS)]}")
            print(f"---- events: {[(e['reason'], e['message']) for e in cluster.events_all()]}")
            print(f"---- status: {(cluster.get(KIND, NS, 'wan') or {}).get('status')}")
            print(f"---- pods: {[(p['metadata']['name'], p['spec'].get('nodeName'), p['status']) for p in cluster.objects('Pod', NS)]}")
            raise
        finally:
            await kubelet.stop()
            kubelet_task.cancel()
            await asyncio.gather(kubelet_task, return_exceptions=True)
