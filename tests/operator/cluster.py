"""Test harness: the API emulator (`emulator.py`), the controllers a cluster runs (`controllers.py`)
and the operator running against them in its own thread (real kopf, real HTTP).

`running_cluster()` serves the emulator on this loop with the garbage collector, the scheduler, what
happens on lost nodes, the Job and (optionally) the StatefulSet controller, and starts the operator
with `config` (status interval 1 s by default: a resync every second; changes are reconciled at
once).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import kmock
import kopf

from dlo.operator import handlers
from dlo.operator.config import OperatorConfig
from dlo.operator.kube import USER_AGENT, Kube
from dlo.operator.leader import Elector, LeaseSettings, lead
from dlo.operator.models import API_VERSION, GROUP, KIND, PLURAL, SINGULAR, VERSION

try:  # the tests import this folder's modules by name (conftest.py puts it on the path) ...
    from controllers import JobController, NodeLifecycle, Scheduler, StatefulSetController, collect_garbage
    from emulator import Emulator, live_objects
except ImportError:  # ... the fleet benchmark (`python -m bench operator-fleet`) as a package
    from tests.operator.controllers import (JobController, NodeLifecycle, Scheduler, StatefulSetController,
                                            collect_garbage)
    from tests.operator.emulator import Emulator, live_objects

__all__ = ["Cluster", "Emulator", "Operator", "TEST_CONFIG", "dlodeployment", "live_objects", "running_cluster"]

TEST_CONFIG = OperatorConfig(status_interval=1.0, fetch_retry_seconds=2.0)
TEST_CLIENT_AGENT = "dlo-tests"  # the test's own requests, told apart from the operator's


@dataclass
class Operator:
    """One operator replica in its thread: its stop flag, its client, its memo (the handlers put
    their loops and node index there) and, with leader election, its elector (`led`: what
    `leader.lead` returned, None while it runs)."""

    thread: threading.Thread
    stop: threading.Event
    kube: Kube
    memo: kopf.Memo
    elector: Elector | None = None
    led: bool | None = None


class Cluster:
    """The emulator, a client for the test, and the operators' threads (stop and start one again
    to play an operator restart; start two with leader election to play a failover)."""

    def __init__(self, emulator: Emulator, kube_timeout: float | None = None,
                 config: OperatorConfig = TEST_CONFIG) -> None:
        self.emulator = emulator
        self.kube = Kube.for_url(str(emulator.url))
        self.kube.user_agent = TEST_CLIENT_AGENT
        self.kube_timeout = kube_timeout
        self.config = config
        self.failures: list[BaseException] = []
        self.operators: dict[str, Operator] = {}

    def start_operator(self, identity: str = "", lease: LeaseSettings | None = None) -> Operator:
        """The operator in a thread; `identity`: one replica with leader election (its client's user
        agent `dlo-operator/<identity>`, its elector's `dlo-operator-lease/<identity>`)."""
        assert identity not in self.operators, f"the operator {identity!r} runs already"
        stop = threading.Event()
        timeout = {} if self.kube_timeout is None else {"timeout": self.kube_timeout}
        url = str(self.emulator.url)
        kube = Kube.for_url(url, **timeout)
        memo = kopf.Memo(kube=kube)
        registry = handlers.registry(self.config, login=False)

        @kopf.on.login(registry=registry)
        def _login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=url)

        def operate(halt: threading.Event) -> None:
            kopf.run(registry=registry, standalone=True, clusterwide=True, stop_flag=halt, memo=memo)

        elector = None
        if identity:
            kube.user_agent = f"{USER_AGENT}/{identity}"
            lease_kube = Kube.for_url(url)
            lease_kube.user_agent = f"{USER_AGENT}-lease/{identity}"
            elector = Elector(lease_kube, lease or LeaseSettings(identity=identity, namespace="dlo-system"))
            kube.fence = elector.fenced
        replica = Operator(threading.Thread(target=lambda: None), stop, kube, memo, elector)

        def run() -> None:
            try:
                if elector is None:
                    operate(stop)
                else:
                    replica.led = lead(elector, operate, stop)
            except BaseException as e:  # surfaced by running_cluster
                self.failures.append(e)

        replica.thread = threading.Thread(target=run, name=f"operator {identity}".strip(), daemon=True)
        replica.thread.start()
        self.operators[identity] = replica
        return replica

    async def stop_operator(self, identity: str = "", crash: bool = False) -> None:
        """Stop an operator and wait for its thread, serving its last requests meanwhile; `crash`:
        it leaves its lease to expire, as a killed process does."""
        replica = self.operators.pop(identity, None)
        if replica is None:
            return
        if crash and replica.elector is not None:
            replica.elector.releases = False
        replica.stop.set()
        while replica.thread.is_alive():
            await asyncio.sleep(0.1)

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


def declare_resources(emulator: Emulator) -> None:
    emulator.resources.load_bundled()
    emulator.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = kmock.ResourceInfo(
        kind=KIND, singular=SINGULAR, namespaced=True, shortnames={"dlod"},
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        subresources={"status", "scale"},
    )


@contextlib.asynccontextmanager
async def running_cluster(with_statefulset_controller: bool = True, ready_when: Callable[[dict], bool] | None = None,
                          with_operator: bool = True, emulator: Emulator | None = None,
                          kube_timeout: float | None = None, config: OperatorConfig | None = None,
                          **overrides: Any) -> AsyncIterator[Cluster]:
    """kmock + GC + scheduler + Job controller (+ StatefulSet controller) on this loop, (+ the operator
    in a thread). `emulator`: an `Emulator` (subclass) to serve, e.g. one that injects faults;
    `kube_timeout`: the operator client's per-request timeout; `config` (or `overrides` of
    TEST_CONFIG's fields): the operator's configuration."""
    emulator = emulator if emulator is not None else Emulator()
    declare_resources(emulator)
    config = config or replace(TEST_CONFIG, **overrides)
    async with emulator, kmock.Server(emulator):
        cluster = Cluster(emulator, kube_timeout, config)
        tasks = [asyncio.create_task(collect_garbage(emulator)), asyncio.create_task(Scheduler().run(emulator)),
                 asyncio.create_task(JobController().run(emulator)), asyncio.create_task(NodeLifecycle().run(emulator))]
        if with_statefulset_controller:
            tasks.append(asyncio.create_task(StatefulSetController(emulator, ready_when).run()))
        if with_operator:
            cluster.start_operator()
        try:
            yield cluster
        finally:
            for identity in list(cluster.operators):  # keep serving kopf's last requests while they stop
                await cluster.stop_operator(identity)
            for task in tasks:
                task.cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            cluster.failures += [r for r in results if isinstance(r, Exception)]  # the emulated controllers
        if cluster.failures:
            raise cluster.failures[0]


def dlodeployment(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": namespace}, "spec": spec}
