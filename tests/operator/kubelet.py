"""A small local kubelet for the e2e test: runs the pods the emulated StatefulSet controller creates.

For each Pod object in the emulator it runs the init containers' commands to completion, then the
main container's command, as local processes with the pod's env (values, field refs and Secret
keys resolved from the emulator) and its volume mounts mapped to local paths (hostPath: the path
itself, or with `node_disks` the path on the pod's node's own disk, a folder per node under the
workdir; emptyDir: a fresh folder; a Secret: its keys as files, laid out as the kubelet does; the
memory-backed /dev/shm stays the host's). It probes the
readiness endpoint and writes the pod status (phase, Ready condition) back to the emulator, and it
terminates a pod's processes once the pod object is gone. Images are ignored: the commands run from
this checkout's environment.

Networking, as far as the engine pods need it: every pod gets its own local port (stable per pod
name) for its container port (`--port N` in its command is rewritten), so replicas can share this
host; each client Service port is a round-robin TCP proxy to the ready pods it selects (kube-proxy's
part); and the headless Service's names `<pod>.<headless>.<ns>.svc` (the engine's
`DLO_PEER_URL_TEMPLATE`) resolve to the pods' local ports through `DLO_PEER_URLS`, which the kubelet
adds to the environment of a container that has the template (cluster DNS's part).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import socket
import signal
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from cluster import Cluster, live_objects
from dlo.operator.kube import _path
from tests.engine.serving_helpers import secret_volume


class PodFailed(RuntimeError):
    pass


@contextlib.asynccontextmanager
async def running_kubelet(cluster: Cluster, workdir: Path, **options: Any) -> AsyncIterator["LocalKubelet"]:
    """A `LocalKubelet` running its pods until the block ends, then stopping them."""
    kubelet = LocalKubelet(cluster, workdir, **options)
    task = asyncio.create_task(kubelet.run())
    try:
        yield kubelet
    finally:  # the loop first: left running, it starts the pods `stop` ends again, processes nobody stops
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await kubelet.stop()


class LocalKubelet:
    def __init__(self, cluster: Cluster, workdir: Path, select: Any = None, node_disks: bool = False) -> None:
        """`select(pod) -> bool`: the pods this kubelet runs (default: every scheduled pod).
        `node_disks`: every node has a disk of its own, as the nodes of a cluster do: a hostPath of a
        pod on node N is `host_path(N, path)`, so the fetches of two nodes into the same cache path
        do not share one folder (default: every node is this host and shares its paths, e.g. a
        model folder placed once for every node)."""
        self.cluster = cluster
        self.workdir = workdir
        self.select = select or (lambda pod: True)
        self.node_disks = node_disks
        self.unpullable: set[str] = set()  # images no registry serves: their pods wait in ImagePullBackOff
        self.tasks: dict[str, asyncio.Task] = {}
        self.processes: dict[str, list[asyncio.subprocess.Process]] = {}
        self.failures: list[str] = []
        self.stopping = False  # set by `stop`: `run` starts no more pods
        self.ports: dict[str, int] = {}  # pod name -> the local port its container port maps to
        self.ready: set[str] = set()  # names of pods whose readiness probe passed
        self.names: dict[str, str] = {}  # pod uid -> name
        self.proxies: dict[int, asyncio.Server] = {}  # client Service port -> its proxy
        self._turn = itertools.count()

    def host_path(self, node: str, path: str | Path) -> Path:
        """Where `path` on `node`'s disk is on this host."""
        if not self.node_disks:
            return Path(path)
        return self.workdir / "nodes" / node / Path(path).relative_to("/")

    def pod_url(self, pod: str) -> str:
        """Where a pod answers on this host (what `<pod>.<headless>` would reach in a cluster)."""
        return f"http://127.0.0.1:{self._port(pod)}"

    def _port(self, pod: str) -> int:
        if pod not in self.ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.ports[pod] = s.getsockname()[1]
        return self.ports[pod]

    def logs(self, pod: str) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.workdir.glob(f"{pod}.*.log")))

    async def run(self) -> None:
        while not self.stopping:
            pods = {p["metadata"]["uid"]: p for p in live_objects(self.cluster.emulator)
                    if p.get("kind") == "Pod" and p["spec"].get("nodeName") and self.select(p)}  # scheduled
            for uid, pod in pods.items():
                if uid not in self.tasks:
                    self.tasks[uid] = asyncio.create_task(self._run_pod(pod))
            for uid in [u for u in self.tasks if u not in pods]:
                await self._end_pod(uid)
            await self._serve_services()
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        self.stopping = True  # `run` starts no pod from here on, whatever order its caller stops things in
        for uid in list(self.tasks):
            await self._end_pod(uid)
        for proxy in self.proxies.values():
            proxy.close()
        self.proxies.clear()

    # ---- Services: a round-robin proxy per client Service port --------------------------------

    async def _serve_services(self) -> None:
        for svc in live_objects(self.cluster.emulator):
            if svc.get("kind") != "Service" or svc["spec"].get("clusterIP") == "None":
                continue
            for port in svc["spec"]["ports"]:
                if port["port"] not in self.proxies:
                    self.proxies[port["port"]] = await asyncio.start_server(
                        lambda r, w, svc=svc: self._proxy(svc, r, w), "127.0.0.1", port["port"])

    async def _proxy(self, svc: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        selector = svc["spec"]["selector"]
        backends = sorted(
            p["metadata"]["name"] for p in live_objects(self.cluster.emulator)
            if p.get("kind") == "Pod" and p["metadata"]["name"] in self.ready
            and p["metadata"]["namespace"] == svc["metadata"]["namespace"]
            and all(p["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())
        )
        if not backends:
            writer.close()
            return
        pod = backends[next(self._turn) % len(backends)]
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._port(pod))
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(OSError):
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    # ---- one pod ----------------------------------------------------------------------------

    async def _run_pod(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        uid = pod["metadata"]["uid"]
        self.names[uid] = name
        if not await self._pulled(pod):
            return
        volumes = await self._mounted(pod)
        if pod["spec"].get("restartPolicy") in ("Never", "OnFailure"):
            await self._run_to_completion(pod, volumes)
            return
        try:
            for c in pod["spec"].get("initContainers", []):
                proc = await self._start(pod, c, volumes)
                await self._patch(pod, {"phase": "Pending", "initContainerStatuses": [
                    {"name": c["name"], "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]})
                if await proc.wait() != 0:
                    raise PodFailed(f"init container {c['name']} exited {proc.returncode}")
            (main,) = pod["spec"]["containers"]
            proc = await self._start(pod, main, volumes)
            await self._patch_status(pod, "Running", ready=False)
            await self._wait_ready(pod, proc)
            self.ready.add(name)
            await self._patch_status(pod, "Running", ready=True)
            code = await proc.wait()
            if uid in self.processes:  # exited on its own, not stopped by us
                raise PodFailed(f"container {main['name']} exited {code}")
        except PodFailed as e:
            self.ready.discard(name)
            self.failures.append(f"{name}: {e}")
            await self._patch_status(pod, "Failed", ready=False)

    async def _run_to_completion(self, pod: dict[str, Any], volumes: dict[str, str | None]) -> None:
        """A Job's pod: its container runs once; the pod ends Succeeded or Failed with the exit code
        and the termination message the container wrote (as the kubelet reports them)."""
        (main,) = pod["spec"]["containers"]
        message_file = self.workdir / f"{pod['metadata']['name']}.{main['name']}.termination"
        proc = await self._start(pod, main, volumes, {main.get("terminationMessagePath", "/dev/termination-log"):
                                                      str(message_file)})
        meta = pod["metadata"]
        self.cluster.emulator.logs[(meta["namespace"], meta["name"])] = (
            lambda: (self.workdir / f"{meta['name']}.{main['name']}.log").read_text(errors="replace"))
        await self._patch(pod, {"phase": "Running", "containerStatuses": [
            {"name": main["name"], "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]})
        code = await proc.wait()
        message = message_file.read_text()[:4096] if message_file.exists() else ""
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error", "message": message}
        await self._patch(pod, {"phase": "Succeeded" if code == 0 else "Failed", "containerStatuses": [
            {"name": main["name"], "state": {"terminated": terminated}}]})

    async def _pulled(self, pod: dict[str, Any]) -> bool:
        """False (the pod waits, as the kubelet's back-off does) when an image cannot be pulled."""
        for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
            if c["image"] in self.unpullable:
                waiting = {"reason": "ImagePullBackOff", "message": f'Back-off pulling image "{c["image"]}"'}
                key = "initContainerStatuses" if c in pod["spec"].get("initContainers", []) else "containerStatuses"
                await self._patch(pod, {"phase": "Pending", key: [{"name": c["name"], "image": c["image"],
                                                                  "state": {"waiting": waiting}}]})
                return False
        return True

    async def _mounted(self, pod: dict[str, Any]) -> dict[str, str | None]:
        """The pod's volumes once they can be set up; meanwhile a FailedMount Event (once), as the
        kubelet posts while it retries."""
        warned = False
        while True:
            try:
                return self._volumes(pod)
            except PodFailed as e:
                if not warned:
                    warned = True
                    meta = pod["metadata"]
                    event = {"apiVersion": "v1", "kind": "Event",
                             "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:10]}",
                                          "namespace": meta["namespace"]},
                             "involvedObject": {"kind": "Pod", "name": meta["name"], "namespace": meta["namespace"]},
                             "reason": "FailedMount", "type": "Warning", "message": f"MountVolume.SetUp failed: {e}"}
                    async with self.cluster.emulator.request("POST", _path("v1", "Event", meta["namespace"]),
                                                             json=event) as resp:
                        assert resp.status < 300, await resp.text()
                await asyncio.sleep(0.5)

    def _volumes(self, pod: dict[str, Any]) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for v in pod["spec"].get("volumes", []):
            if "hostPath" in v:
                path = self.host_path(pod["spec"]["nodeName"], v["hostPath"]["path"])
                if v["hostPath"].get("type") == "DirectoryOrCreate":
                    path.mkdir(parents=True, exist_ok=True)
                elif v["hostPath"].get("type") == "Directory" and not path.is_dir():
                    raise PodFailed(f"volume {v['name']}: hostPath {path} is not a directory")
                out[v["name"]] = str(path)
            elif v.get("emptyDir", {}).get("medium") == "Memory":
                out[v["name"]] = None  # the host's /dev/shm
            elif "emptyDir" in v:
                out[v["name"]] = tempfile.mkdtemp(prefix=f"{v['name']}-", dir=self.workdir)
            elif "persistentVolumeClaim" in v:  # one folder per claim, shared by every pod (ReadWriteMany)
                shared = self.workdir / f"pvc-{v['persistentVolumeClaim']['claimName']}"
                shared.mkdir(exist_ok=True)
                out[v["name"]] = str(shared)
            elif "secret" in v:
                out[v["name"]] = self._secret_volume(pod["metadata"]["namespace"], v)
            else:
                raise PodFailed(f"volume {v['name']}: only hostPath, emptyDir, claims and Secrets run locally")
        return out

    def _secret_volume(self, namespace: str, volume: dict[str, Any]) -> str:
        """A Secret's keys as files, laid out as the kubelet writes them (`..data` and a link per key)."""
        ref = volume["secret"]
        secret = self.cluster.get("Secret", namespace, ref["secretName"])
        if secret is None:
            raise PodFailed(f"volume {volume['name']}: secret {ref['secretName']} not found")
        files = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
        files.update({k: v.encode() for k, v in (secret.get("stringData") or {}).items()})
        folder = Path(tempfile.mkdtemp(prefix=f"{volume['name']}-", dir=self.workdir))
        return str(secret_volume(folder, files, ref.get("defaultMode", 0o644)))

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

    def _peer_urls(self, pod: dict[str, Any]) -> dict[str, str]:
        """Every pod of this pod's StatefulSet -> its local URL (the headless Service's DNS names)."""
        owner = next(r for r in pod["metadata"]["ownerReferences"] if r["kind"] == "StatefulSet")
        sts = self.cluster.get("StatefulSet", pod["metadata"]["namespace"], owner["name"])
        replicas = sts["spec"]["replicas"] if sts else 1
        return {f"{owner['name']}-{i}": self.pod_url(f"{owner['name']}-{i}") for i in range(replicas)}

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
                value = self._secret(pod["metadata"]["namespace"], e["valueFrom"]["secretKeyRef"])
                if value is not None:  # an optional key the Secret lacks: no variable, as the kubelet does
                    env[e["name"]] = value
            else:
                raise PodFailed(f"env {e['name']}: unsupported source {e.get('valueFrom')}")
        if "DLO_PEER_URL_TEMPLATE" in env:
            env["DLO_PEER_URLS"] = json.dumps(self._peer_urls(pod))
        return env

    def _secret(self, namespace: str, ref: dict[str, Any]) -> str | None:
        secret = self.cluster.get("Secret", namespace, ref["name"])
        if secret is None:
            raise PodFailed(f"secret {ref['name']} not found")
        if ref["key"] in (secret.get("data") or {}):
            return base64.b64decode(secret["data"][ref["key"]]).decode()
        if ref["key"] in (secret.get("stringData") or {}):  # the emulator keeps stringData as sent
            return secret["stringData"][ref["key"]]
        if ref.get("optional"):
            return None
        raise PodFailed(f"secret {ref['name']} has no key {ref['key']}")

    async def _start(self, pod: dict[str, Any], container: dict[str, Any], volumes,
                     files: dict[str, str] | None = None) -> asyncio.subprocess.Process:
        translate = self._mapper(container, volumes)
        argv = [(files or {}).get(a) or translate(a) for a in container["command"] + container.get("args", [])]
        container_ports = {str(p["containerPort"]) for p in container.get("ports", [])}
        for i, arg in enumerate(argv[:-1]):
            if arg == "--port" and argv[i + 1] in container_ports:  # this pod's own port on this host
                argv[i + 1] = str(self._port(pod["metadata"]["name"]))
        log = open(self.workdir / f"{pod['metadata']['name']}.{container['name']}.log", "ab")
        proc = await asyncio.create_subprocess_exec(
            *argv, env=self._env(pod, container, translate), stdout=log, stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True,
        )
        log.close()
        self.processes.setdefault(pod["metadata"]["uid"], []).append(proc)
        return proc

    async def _wait_ready(self, pod: dict[str, Any], proc: asyncio.subprocess.Process) -> None:
        (container,) = pod["spec"]["containers"]
        probe = container["readinessProbe"]["httpGet"]
        url = f"{self.pod_url(pod['metadata']['name'])}{probe['path']}"
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while proc.returncode is None:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            return
                await asyncio.sleep(0.5)
        raise PodFailed(f"container {container['name']} exited {proc.returncode} before it was ready")

    async def _patch_status(self, pod: dict[str, Any], phase: str, ready: bool) -> None:
        await self._patch(pod, {"phase": phase, "conditions": [{"type": "Ready", "status": str(ready)}]})

    async def _patch(self, pod: dict[str, Any], status: dict[str, Any]) -> None:
        meta = pod["metadata"]
        path = _path("v1", "Pod", meta["namespace"], meta["name"])
        async with self.cluster.emulator.request(
            "PATCH", path, json={"status": status}, headers={"Content-Type": "application/merge-patch+json"}
        ) as resp:
            assert resp.status in (200, 404), await resp.text()

    async def _end_pod(self, uid: str) -> None:
        """The pod's task ended first (so it starts no container while its processes stop), then its
        processes: stopping them first let a task waiting on an init container start the main one
        after the stop, a `dlo serve` nobody would stop."""
        task = self.tasks.pop(uid, None)
        if task is None:  # `run` and `stop` both ending it: the first does
            return
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await self._stop(uid)

    async def _stop(self, uid: str) -> None:
        """Terminate a pod's processes (their whole process groups), SIGKILL after a grace period."""
        self.ready.discard(self.names.pop(uid, ""))
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
