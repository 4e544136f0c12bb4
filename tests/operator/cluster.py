"""Test harness: a stateful Kubernetes API emulator (kmock) with the operator running against it.

kmock serves real HTTP; kopf runs unchanged in its own thread. The emulator lacks parts of a real
API server, added here rather than weakening assertions:
- metadata: uid, resourceVersion, creationTimestamp and generation (bumped on spec changes);
- garbage collection: objects whose owner (by uid) is gone are deleted, like the real collector;
- a StatefulSet controller (`StatefulSetController`): pods from the template, one per ordinal,
  OnDelete / RollingUpdate semantics by the operator's template hash, scheduled onto fake nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import json
import os
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

os.environ.setdefault("DLO_OPERATOR_STATUS_INTERVAL", "1")

import jsonpatch  # noqa: E402
import kmock  # noqa: E402
import kopf  # noqa: E402

import dlo.operator.handlers  # noqa: E402,F401  (registers the handlers)
from dlo.operator import builders  # noqa: E402
from dlo.operator.kube import Kube, _path  # noqa: E402
from dlo.operator.models import API_VERSION, GROUP, KIND, PLURAL, SINGULAR, VERSION  # noqa: E402

_counter = itertools.count(1)
_LOGIN: dict[str, str] = {}


@kopf.on.login()
def _login_to_emulator(**_: Any) -> kopf.ConnectionInfo:
    return kopf.ConnectionInfo(server=_LOGIN["url"])


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


class Emulator(kmock.KubernetesEmulator):
    """kmock plus what an API server assigns (uid, resourceVersion, timestamps, generation, names
    from generateName) and its answer to a stale JSON-patch test (422, not 500)."""

    async def _handle(self, request):  # type: ignore[override]
        data = request.data
        if request.resource is not None and request.action == kmock.action.CREATE and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta.setdefault("uid", str(uuid.uuid4()))
            meta["resourceVersion"] = str(next(_counter))
            meta.setdefault("creationTimestamp", _now())
            meta.setdefault("generation", 1)
        elif request.resource is not None and request.action == kmock.action.UPDATE and request.name:
            key = (request.resource, request.namespace, request.name)
            current = self.objects[key] if key in self.objects else None
            generation = (current.get("metadata", {}).get("generation") or 1) if current is not None else 1
            rv = str(next(_counter))
            if isinstance(data, dict):
                meta = data.setdefault("metadata", {})
                meta["resourceVersion"] = rv
                if "spec" in data and request.subresource != "status":
                    meta["generation"] = generation + 1
            elif isinstance(data, list):
                data.append({"op": "replace", "path": "/metadata/resourceVersion", "value": rv})
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as e:
            # A stale resourceVersion: a real API server answers 422 and the client re-reads.
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(e)) from None


def live_objects(emulator: Emulator) -> list[dict[str, Any]]:
    return [obj.raw for (_, _, _), obj in emulator.objects.items() if not obj.deleted]


async def collect_garbage(emulator: Emulator) -> None:
    """Delete every object whose controller owner no longer exists (the garbage collector)."""
    while True:
        uids = {o["metadata"].get("uid") for o in live_objects(emulator)}
        for obj in live_objects(emulator):
            refs = obj["metadata"].get("ownerReferences") or []
            if refs and not any(r.get("uid") in uids for r in refs):
                meta = obj["metadata"]
                path = _path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
                async with emulator.delete(path) as resp:
                    assert resp.status in (200, 404), await resp.text()
        await asyncio.sleep(0.1)


class StatefulSetController:
    """Plays the StatefulSet controller and the scheduler: one pod per ordinal on node `node-<i>`.

    Pods become Ready through `ready_when(pod) -> bool` (default: at once). With OnDelete, pods of
    an old template stay until someone deletes them; with RollingUpdate they are replaced.
    """

    def __init__(self, emulator: Emulator, ready_when: Callable[[dict], bool] | None = None) -> None:
        self.emulator = emulator
        self.ready_when = ready_when or (lambda pod: True)

    def pods_of(self, sts: dict[str, Any]) -> dict[str, dict[str, Any]]:
        ns = sts["metadata"]["namespace"]
        return {
            o["metadata"]["name"]: o
            for o in live_objects(self.emulator)
            if o.get("kind") == "Pod"
            and o["metadata"].get("namespace") == ns
            and any(r.get("uid") == sts["metadata"]["uid"] for r in o["metadata"].get("ownerReferences", []))
        }

    async def step(self) -> None:
        for sts in [o for o in live_objects(self.emulator) if o.get("kind") == "StatefulSet"]:
            meta, spec = sts["metadata"], sts["spec"]
            template = spec["template"]
            want = template["metadata"]["annotations"][builders.TEMPLATE_HASH]
            pods = self.pods_of(sts)
            for name, pod in list(pods.items()):
                ordinal = int(name.rsplit("-", 1)[1])
                stale = pod["metadata"]["annotations"][builders.TEMPLATE_HASH] != want
                if ordinal >= spec["replicas"] or (stale and spec["updateStrategy"]["type"] == "RollingUpdate"):
                    await self._request("DELETE", _path("v1", "Pod", meta["namespace"], name))
                    pods.pop(name)
            for i in range(spec["replicas"]):
                name = f"{meta['name']}-{i}"
                if name not in pods:
                    await self._request("POST", _path("v1", "Pod", meta["namespace"]), self._pod(sts, name, i))
                elif self.ready_when(pods[name]) and pods[name]["status"]["phase"] != "Running":
                    status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
                    await self._request("PATCH", _path("v1", "Pod", meta["namespace"], name), {"status": status})

    def _pod(self, sts: dict[str, Any], name: str, ordinal: int) -> dict[str, Any]:
        template = json.loads(json.dumps(sts["spec"]["template"]))
        meta = template["metadata"]
        meta.update(
            name=name,
            namespace=sts["metadata"]["namespace"],
            ownerReferences=[
                {
                    "apiVersion": "apps/v1",
                    "kind": "StatefulSet",
                    "name": sts["metadata"]["name"],
                    "uid": sts["metadata"]["uid"],
                    "controller": True,
                }
            ],
        )
        spec = {**template["spec"], "nodeName": f"node-{ordinal}", "hostname": name}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec,
                "status": {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}]}}

    async def _request(self, method: str, path: str, body: Any = None) -> None:
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        async with self.emulator.request(method, path, json=body, headers=headers) as resp:
            assert resp.status < 300 or resp.status == 404, await resp.text()

    async def run(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(0.1)


TEST_CLIENT_AGENT = "dlo-tests"  # the test's own requests, told apart from the operator's


class Cluster:
    """The emulator, a client for the test, and the operator's thread (stop and start it again
    to play an operator restart)."""

    def __init__(self, emulator: Emulator, kube_timeout: float | None = None) -> None:
        self.emulator = emulator
        self.kube = Kube.for_url(str(emulator.url))
        self.kube._api.user_agent = TEST_CLIENT_AGENT
        self.kube_timeout = kube_timeout
        self.failures: list[BaseException] = []
        self._operator: tuple[threading.Thread, threading.Event] | None = None

    def start_operator(self) -> None:
        assert self._operator is None, "the operator runs already"
        stop = threading.Event()
        timeout = {} if self.kube_timeout is None else {"timeout": self.kube_timeout}
        memo = kopf.Memo(kube=Kube.for_url(str(self.emulator.url), **timeout))

        def operate() -> None:
            try:
                kopf.run(standalone=True, clusterwide=True, stop_flag=stop, memo=memo)
            except BaseException as e:  # surfaced by running_cluster
                self.failures.append(e)

        thread = threading.Thread(target=operate, name="operator", daemon=True)
        thread.start()
        self._operator = (thread, stop)

    async def stop_operator(self) -> None:
        """Stop the operator and wait for its thread, serving its last requests meanwhile."""
        if self._operator is None:
            return
        thread, stop = self._operator
        stop.set()
        while thread.is_alive():
            await asyncio.sleep(0.1)
        self._operator = None

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        # The emulator serves on this loop: blocking client calls go to a thread.
        return await asyncio.to_thread(fn, *args)

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        return await self.call(self.kube.create, obj)

    async def patch_dlod(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        return await self.call(self.kube.patch, API_VERSION, KIND, namespace, name, patch)

    async def delete_dlod(self, namespace: str, name: str) -> bool:
        return await self.call(self.kube.delete, API_VERSION, KIND, namespace, name)

    def get(self, kind: str, namespace: str | None, name: str, api_version: str | None = None) -> dict[str, Any] | None:
        for obj in live_objects(self.emulator):
            meta = obj.get("metadata", {})
            if obj.get("kind") == kind and meta.get("namespace") == namespace and meta.get("name") == name:
                if api_version is None or obj.get("apiVersion") == api_version:
                    return obj
        return None

    def objects(self, kind: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return [
            o
            for o in live_objects(self.emulator)
            if o.get("kind") == kind and (namespace is None or o["metadata"].get("namespace") == namespace)
        ]

    def events_all(self) -> list[dict[str, Any]]:
        # kopf posts events without apiVersion/kind: find them by resource.
        return [
            obj.raw for (resource, _, _), obj in self.emulator.objects.items()
            if resource.plural == "events" and not obj.deleted
        ]

    def events(self, reason: str) -> list[dict[str, Any]]:
        return [e for e in self.events_all() if e.get("reason") == reason]

    async def wait(self, predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            result = predicate()
            if result:
                return result
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            await asyncio.sleep(0.1)

    async def add_node(self, name: str, labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
                       allocatable: dict[str, str] | None = None) -> dict[str, Any]:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})},
                         "annotations": annotations or {}},
            "status": {"allocatable": allocatable or {"cpu": "2"}},
        }
        return await self.create(node)


@contextlib.asynccontextmanager
async def running_cluster(with_statefulset_controller: bool = True, ready_when: Callable[[dict], bool] | None = None,
                          with_operator: bool = True, emulator: Emulator | None = None,
                          kube_timeout: float | None = None) -> AsyncIterator[Cluster]:
    """kmock + GC (+ StatefulSet controller) on this loop, (+ the operator in a thread).

    `emulator`: an `Emulator` (subclass) to serve, e.g. one that injects faults;
    `kube_timeout`: the operator client's per-request timeout (default: the operator's own).
    """
    emulator = emulator if emulator is not None else Emulator()
    emulator.resources.load_bundled()
    emulator.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = kmock.ResourceInfo(
        kind=KIND, singular=SINGULAR, namespaced=True, shortnames={"dlod"},
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        subresources={"status", "scale"},
    )
    async with emulator, kmock.Server(emulator):
        _LOGIN["url"] = str(emulator.url)
        cluster = Cluster(emulator, kube_timeout)
        tasks = [asyncio.create_task(collect_garbage(emulator))]
        if with_statefulset_controller:
            tasks.append(asyncio.create_task(StatefulSetController(emulator, ready_when).run()))
        if with_operator:
            cluster.start_operator()
        try:
            yield cluster
        finally:
            await cluster.stop_operator()  # keep serving kopf's last requests while it stops
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            cluster.failures += [r for r in results if isinstance(r, Exception)]  # the emulated controllers
        if cluster.failures:
            raise cluster.failures[0]


def dlodeployment(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": namespace}, "spec": spec}
