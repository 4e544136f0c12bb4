"""End to end, `engine.apiKeys`: examples/dlodeployment-tenants.yaml (its Secret of named keys and
its DLODeployment) on the tiny model; the operator mounts the Secret read-only and passes
`--api-keys` and `--admin-key`; the local kubelet lays the Secret out as a kubelet does (`..data`
and a link per key) and runs `dlo serve`; through the client Service each key is its own tenant:
another tenant's video job is a 404, the admin key sees it, and the metrics name the tenants."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

from cluster import running_cluster
from dlo.operator.models import API_KEY_ENV, KIND
from dlo.operator.names import API_KEYS_MOUNT
from kubelet import running_kubelet
from test_operator_e2e import NS, ROOT, free_port, tiny_model  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow


def resources(model: Path, port: int) -> tuple[dict, dict]:
    docs = [d for d in yaml.safe_load_all((ROOT / "examples" / "dlodeployment-tenants.yaml").read_text()) if d]
    secret = next(d for d in docs if d["kind"] == "Secret")
    res = next(d for d in docs if d["kind"] == KIND)
    spec = res["spec"]
    spec.update(replicas=1, devicesPerNode=1, service={"port": port})
    spec["model"]["path"] = str(model)
    spec["engine"].update(device="cpu", args=[*spec["engine"]["args"], "--small-limits"])
    for obj in (secret, res):
        obj["metadata"]["namespace"] = NS
    return secret, res


async def call(method: str, url: str, key: str, body: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with session.request(method, url, json=body, headers={"Authorization": f"Bearer {key}"}) as resp:
            return resp.status, await resp.json()


async def test_each_key_of_the_secret_is_a_tenant_of_the_served_model(tiny_model, tmp_path):
    port = free_port()
    secret, res = resources(tiny_model, port)
    keys = secret["stringData"]
    async with running_cluster(ready_when=lambda pod: False) as cluster, running_kubelet(cluster, tmp_path) as kubelet:
        try:
            await cluster.add_node("node-0", labels=res["spec"]["placement"]["nodeSelector"],
                                   allocatable={"cpu": "4", "memory": "16Gi"})
            for obj in (secret, res):
                await cluster.create(obj)

            def ready() -> bool:
                assert not kubelet.failures, (kubelet.failures, kubelet.logs("wan-0"))
                return (cluster.get(KIND, NS, "wan") or {}).get("status", {}).get("readyReplicas") == 1

            await cluster.wait(ready, timeout=240, what="the DLODeployment ready")
            pod = cluster.get("Pod", NS, "wan-0")
            (engine,) = pod["spec"]["containers"]
            command = " ".join(engine["command"])
            assert f"--api-keys {API_KEYS_MOUNT} --admin-key ops" in command
            assert {"name": "api-keys", "mountPath": API_KEYS_MOUNT, "readOnly": True} in engine["volumeMounts"]
            assert {"name": "api-keys", "secret": {"secretName": "wan-tenants", "defaultMode": 0o440}} in \
                pod["spec"]["volumes"]
            assert API_KEY_ENV not in {e["name"] for e in engine["env"]} and "change-me" not in str(pod)
            url = f"http://127.0.0.1:{port}/v1/videos"  # the client Service
            status, job = await call("POST", url, keys["team-a"], {"prompt": "a's", "size": "64x64",
                                                                    "num_frames": 5, "num_inference_steps": 1})
            assert status == 200, job
            deadline = time.monotonic() + 120
            while (await call("GET", f"{url}/{job['id']}", keys["team-a"]))[1]["status"] not in ("completed", "failed"):
                assert time.monotonic() < deadline, "the video job never ended"
                await asyncio.sleep(0.1)
            assert (await call("GET", f"{url}/{job['id']}", keys["team-b"]))[0] == 404
            assert (await call("GET", url, keys["team-b"]))[1]["data"] == []
            assert [j["id"] for j in (await call("GET", url, keys["ops"]))[1]["data"]] == [job["id"]]
            assert (await call("GET", url, "change-me-c"))[0] == 401
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    metrics = await resp.text()
            assert 'tenant="team-a"' in metrics and 'tenant="ops"' in metrics and "change-me" not in metrics
        except BaseException:
            print(f"---- pod wan-0 logs ----\n{kubelet.logs('wan-0')[-6000:]}")
            print(f"---- events: {[(e['reason'], e['message']) for e in cluster.events_all()]}")
            raise
