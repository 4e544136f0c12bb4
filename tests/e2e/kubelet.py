"""A small local kubelet for the e2e test: runs the pods the emulated StatefulSet controller creates.

For each Pod object in the emulator it runs the init containers' commands to completion, then the
main container's command, as local processes with the pod's env (values, field refs and Secret
keys resolved from the emulator) and its volume mounts mapped to local paths (hostPath: the path
itself; emptyDir: a fresh folder; the memory-backed /dev/shm stays the host's). It probes the
readiness endpoint and writes the pod status (phase, Ready condition) back to the emulator, and it
terminates a pod's processes once the pod object is gone. Images are ignored: the commands run from
this checkout's environment.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from cluster import Cluster, live_objects
from dlo.operator.kube import _path


class PodFailed(RuntimeError):
    pass


class LocalKubelet:
    def __init__(self, cluster: Cluster, workdir: Path) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.tasks: dict[str, asyncio.Task] = {}
        self.processes: dict[str, list[asyncio.subprocess.Process]] = {}
        self.failures: list[str] = []

    def logs(self, pod: str) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.workdir.glob(f"{pod}.*.log")))

    async def run(self) -> None:
        while True:
            pods = {p["metadata"]["uid"]: p for p in live_objects(self.cluster.emulator) if p.get("kind") == "Pod"}
            for uid, pod in pods.items():
                if uid not in self.tasks:
                    self.tasks[uid] = asyncio.create_task(self._run_pod(pod))
            for uid in [u for u in self.tasks if u not in pods]:
                await self._stop(uid)
                self.tasks.pop(uid).cancel()
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        for uid in list(self.tasks):
            await self._stop(uid)
            self.tasks.pop(uid).cancel()

    # ---- one pod ----------------------------------------------------------------------------

    async def _run_pod(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        uid = pod["metadata"]["uid"]
        volumes = self._volumes(pod)
        try:
            for c in pod["spec"].get("initContainers", []):
                proc = await self._start(pod, c, volumes)
                if await proc.wait() != 0:
                    raise PodFailed(f"init container {c['name']} exited {proc.returncode}")
            (main,) = pod["spec"]["containers"]
            proc = await self._start(pod, main, volumes)
            await self._patch_status(pod, "Running", ready=False)
            await self._wait_ready(main, proc)
            await self._patch_status(pod, "Running", ready=True)
            code = await proc.wait()
            if uid in self.processes:  # exited on its own, not stopped by us
                raise PodFailed(f"container {main['name']} exited {code}")
        except PodFailed as e:
            self.failures.append(f"{name}: {e}")
            await self._patch_status(pod, "Failed", ready=False)

    def _volumes(self, pod: dict[str, Any]) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for v in pod["spec"].get("volumes", []):
            if "hostPath" in v:
                out[v["name"]] = v["hostPath"]["path"]
            elif v.get("emptyDir", {}).get("medium") == "Memory":
                out[v["name"]] = None  # the host's /dev/shm
            elif "emptyDir" in v:
                out[v["name"]] = tempfile.mkdtemp(prefix=f"{v['name']}-", dir=self.workdir)
            else:
                raise PodFailed(f"volume {v['name']}: only hostPath and emptyDir run locally")
        return out

    @staticmethod
    def _mapper(container: dict[str, Any], volumes: dict[str, str | None]):
        mounts = []
        for m in container.get("volumeMounts", []):
            host = volumes[m["name"]]
            if host is not None:
                mounts.append((m["mountPath"], os.path.join(host, m.get("subPath", "")).rstrip("/")))
        mounts.sort(key=lambda pair: -len(pair[0]))

        def translate(value: str) -> str:
            for mount, host in mounts:
                if value == mount or value.startswith(mount + "/"):
                    return host + value[len(mount):]
            return value

        return translate

    def _env(self, pod: dict[str, Any], container: dict[str, Any], translate) -> dict[str, str]:
        env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
        fields = {"spec.nodeName": pod["spec"].get("nodeName", ""), "metadata.name": pod["metadata"]["name"],
                  "metadata.namespace": pod["metadata"]["namespace"]}
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = translate(e["value"])
            elif "fieldRef" in e.get("valueFrom", {}):
                env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in e.get("valueFrom", {}):
                env[e["name"]] = self._secret(pod["metadata"]["namespace"], e["valueFrom"]["secretKeyRef"])
            else:
                raise PodFailed(f"env {e['name']}: unsupported source {e.get('valueFrom')}")
        return env

    def _secret(self, namespace: str, ref: dict[str, str]) -> str:
        secret = self.cluster.get("Secret", namespace, ref["name"])
        if secret is None:
            raise PodFailed(f"secret {ref['name']} not found")
        if ref["key"] in (secret.get("data") or {}):
            return base64.b64decode(secret["data"][ref["key"]]).decode()
        if ref["key"] in (secret.get("stringData") or {}):  # the emulator keeps stringData as sent
            return secret["stringData"][ref["key"]]
        raise PodFailed(f"secret {ref['name']} has no key {ref['key']}")

    async def _start(self, pod: dict[str, Any], container: dict[str, Any], volumes) -> asyncio.subprocess.Process:
        translate = self._mapper(container, volumes)
        argv = [translate(a) for a in container["command"] + container.get("args", [])]
        log = open(self.workdir / f"{pod['metadata']['name']}.{container['name']}.log", "ab")
        proc = await asyncio.create_subprocess_exec(
            *argv, env=self._env(pod, container, translate), stdout=log, stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True,
        )
        log.close()
        self.processes.setdefault(pod["metadata"]["uid"], []).append(proc)
        return proc

    async def _wait_ready(self, container: dict[str, Any], proc: asyncio.subprocess.Process) -> None:
        probe = container["readinessProbe"]["httpGet"]
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        port = ports.get(probe["port"], probe["port"])
        url = f"http://127.0.0.1:{port}{probe['path']}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while proc.returncode is None:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(0.5)
        raise PodFailed(f"container {container['name']} exited {proc.returncode} before it was ready")

    async def _patch_status(self, pod: dict[str, Any], phase: str, ready: bool) -> None:
        meta = pod["metadata"]
        status = {"phase": phase, "conditions": [{"type": "Ready", "status": str(ready)}]}
        path = _path("v1", "Pod", meta["namespace"], meta["name"])
        async with self.cluster.emulator.request(
            "PATCH", path, json={"status": status}, headers={"Content-Type": "application/merge-patch+json"}
        ) as resp:
            assert resp.status in (200, 404), await resp.text()

    async def _stop(self, uid: str) -> None:
        """Terminate a pod's processes (their whole process groups), SIGKILL after a grace period."""
        for proc in self.processes.pop(uid, []):
            if proc.returncode is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout=30)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
