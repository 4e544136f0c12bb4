"""Operator faults against the API emulator with the real operator (kopf in its own thread):
injected API errors (500, 503, 409), writes whose answer is lost after they were applied, calls
that hang past the client's timeout, operator restarts mid-reconcile, and invalid resources.

The outcome asserted every time: the operator converges to the same objects it makes without
faults, with no duplicates (one StatefulSet, two Services, one PDB, one owner reference each, one
condition per type), and it never stops reconciling. Each scenario prints a `FIGURE` line (time to
converge, faults injected) for bench/results.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kmock
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "operator"))

from cluster import TEST_CONFIG, Cluster, Emulator, dlodeployment, running_cluster  # noqa: E402
from dlo.operator import builders  # noqa: E402
from dlo.operator.kube import USER_AGENT  # noqa: E402
from test_handlers import CHILDREN, NS, RECREATE, SPEC, add_gpu_nodes, condition, status_of  # noqa: E402

pytestmark = pytest.mark.slow  # about 55 s of emulator time on 2 cores
INTERVAL = TEST_CONFIG.status_interval  # 1 s under test


@dataclass
class Fault:
    """What happens to the next `times` requests of the operator's own client that match
    (`method`/`plural` "*": any).

    `status`: answer this error instead of applying the request; with `after_commit`, apply it
    and then answer the error (the answer was lost). `hang`: hold the request before applying it
    until `release` is set or `hang` seconds pass (an API server that stops answering).
    """

    method: str
    plural: str
    status: int | None = None
    times: int = 1
    after_commit: bool = False
    hang: float = 0.0
    subresource: str | None = None
    fired: int = 0

    def matches(self, request: Any) -> bool:
        return (
            self.fired < self.times
            and request.resource is not None
            and self.method in (request.method.value, "*")
            and self.plural in (request.resource.plural, "*")
            and (self.subresource == request.subresource or self.plural == "*")
            and request.headers.get("User-Agent", "").startswith(USER_AGENT)
        )


class FaultyEmulator(Emulator):
    """The emulator with a fault `plan`; `release` lets hung requests go on; `landed`: when each
    released request was applied (monotonic seconds), `on_landed` called right then."""

    plan: list[Fault]
    release: asyncio.Event
    landed: list[float]
    on_landed: Any = None  # called once a released request is applied

    async def _handle(self, request):  # type: ignore[override]
        fault = next((f for f in self.plan if f.matches(request)), None)
        if fault is None:
            return await super()._handle(request)
        fault.fired += 1
        # Shielded: a request the client gave up on (its timeout) is still applied when released,
        # like a write already on its way to storage.
        return await asyncio.shield(asyncio.ensure_future(self._faulty(request, fault)))

    async def _faulty(self, request: Any, fault: Fault) -> Any:
        if fault.hang:
            try:
                await asyncio.wait_for(self.release.wait(), fault.hang)
            except TimeoutError:
                pass
        if fault.status is None:
            response = await super()._handle(request)
            self.landed.append(time.monotonic())  # applied (a refused write raises above)
            if self.on_landed is not None:  # before anyone else runs: the state the write left
                self.on_landed()
            return response
        if fault.after_commit:
            await super()._handle(request)
        raise kmock.KubernetesError(status=fault.status, reason="Injected", message=f"injected {fault.status}")


def make_emulator(*plan: Fault) -> FaultyEmulator:
    emulator = FaultyEmulator()
    emulator.plan = list(plan)
    emulator.release = asyncio.Event()
    emulator.landed = []
    return emulator


def ready(cluster: Cluster, replicas: int = 2) -> bool:
    st = status_of(cluster)
    return (condition(cluster, "Ready") or {}).get("status") == "True" and st.get("readyReplicas") == replicas


def assert_converged(cluster: Cluster, replicas: int = 2) -> None:
    """Exactly the objects the operator makes without faults, none twice, each owned once."""
    owner = cluster.get("DLODeployment", NS, "wan")
    for kind, count in (("StatefulSet", 1), ("Service", 2), ("PodDisruptionBudget", 1), ("Pod", replicas)):
        assert len(cluster.objects(kind, NS)) == count, (kind, [o["metadata"]["name"] for o in cluster.objects(kind, NS)])
    for kind, name in CHILDREN:
        refs = cluster.get(kind, NS, name)["metadata"]["ownerReferences"]
        assert [r["uid"] for r in refs] == [owner["metadata"]["uid"]], (kind, refs)
    types = [c["type"] for c in status_of(cluster)["conditions"]]
    assert sorted(types) == sorted(set(types)) == ["CacheWarmed", "Degraded", "ModelReady", "PlanOutdated", "Progressing",
                                                   "Ready"]
    assert condition(cluster, "Degraded")["status"] == "False"
    sts = cluster.get("StatefulSet", NS, "wan")
    want = sts["spec"]["template"]["metadata"]["annotations"][builders.TEMPLATE_HASH]
    assert all(p["metadata"]["annotations"][builders.TEMPLATE_HASH] == want for p in cluster.objects("Pod", NS))


def figure(name: str, **values: Any) -> None:
    print("FIGURE", name, " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()))


async def create_and_wait_ready(cluster: Cluster, timeout: float = 30.0, spec: dict[str, Any] = SPEC) -> float:
    await add_gpu_nodes(cluster)
    started = time.monotonic()
    await cluster.create(dlodeployment("wan", NS, spec))
    await cluster.wait(lambda: ready(cluster), timeout=timeout, what="Ready")
    return time.monotonic() - started


async def ready_then_hang(cluster: Cluster, method: str, plural: str, spec_patch: dict | None = None) -> Fault:
    """Converge, then hold the operator's next `method` on `plural` (after `spec_patch`, if any)."""
    await create_and_wait_ready(cluster)
    hang = Fault(method, plural, status=None, hang=600.0)
    cluster.emulator.plan.append(hang)  # type: ignore[attr-defined]
    if spec_patch is not None:
        await cluster.patch_dlod(NS, "wan", {"spec": spec_patch})
    await cluster.wait(lambda: hang.fired, what=f"the operator's hung {method} {plural}")
    return hang


async def test_baseline_without_faults():
    async with running_cluster() as cluster:
        seconds = await create_and_wait_ready(cluster)
        assert_converged(cluster)
    figure("baseline", seconds_to_ready=seconds)


async def test_api_errors_on_every_call_kind_then_converges():
    faults = [
        Fault("PATCH", "services", 500, times=2),  # server-side apply: creates and patches are PATCHes
        Fault("PATCH", "poddisruptionbudgets", 503),
        Fault("PATCH", "statefulsets", 500, times=2),
        Fault("PATCH", "dlodeployments", 500, subresource="status"),  # the status write
        Fault("DELETE", "pods", 500),  # the Recreate rollout below
        Fault("PATCH", "statefulsets", 409, times=2),  # a conflict
    ]
    async with running_cluster(emulator=make_emulator(*faults)) as cluster:
        seconds = await create_and_wait_ready(cluster, spec=RECREATE)
        assert_converged(cluster)
        await cluster.patch_dlod(NS, "wan", {"spec": {"mode": "rank-local"}})
        started = time.monotonic()
        await cluster.wait(lambda: status_of(cluster).get("observedGeneration") == 2 and status_of(cluster).get("mode")
                           == "rank-local" and ready(cluster), timeout=30, what="rolled to rank-local")
        rolled = time.monotonic() - started
        assert_converged(cluster)
        assert [(f.method, f.plural, f.fired) for f in faults if f.fired != f.times] == []
    figure("api_errors", injected=sum(f.times for f in faults), seconds_to_ready=seconds, seconds_to_roll=rolled)


async def test_a_persistent_api_error_shows_as_degraded_and_clears_when_it_stops():
    # e.g. a role without create on statefulsets: the resource says why nothing moves
    forbidden = Fault("PATCH", "statefulsets", 403, times=1_000_000)
    async with running_cluster(emulator=make_emulator(forbidden)) as cluster:
        await add_gpu_nodes(cluster)
        await cluster.create(dlodeployment("wan", NS, SPEC))

        def degraded() -> dict | None:
            c = condition(cluster, "Degraded")
            return c if c and c["status"] == "True" else None

        await cluster.wait(degraded, what="Degraded")
        assert degraded()["reason"] == "ApiError"
        assert "403" in degraded()["message"] and "statefulsets" in degraded()["message"]
        assert cluster.get("StatefulSet", NS, "wan") is None
        forbidden.times = forbidden.fired  # the role is fixed
        started = time.monotonic()
        await cluster.wait(lambda: ready(cluster), timeout=30, what="Ready once allowed")
        seconds = time.monotonic() - started
        assert condition(cluster, "Degraded")["status"] == "False"
        assert_converged(cluster)
    figure("persistent_error", refused_calls=forbidden.fired, seconds_to_ready_after_fix=seconds)


async def test_lost_answers_after_applied_writes_do_not_duplicate_or_recreate():
    # The write happens, the answer is an error: the operator applies again, which adopts what is
    # there (the same object, its field manager's) instead of failing for ever or replacing it.
    faults = [
        Fault("PATCH", "services", 500, after_commit=True),
        Fault("PATCH", "statefulsets", 409, after_commit=True),
        Fault("PATCH", "poddisruptionbudgets", 504, after_commit=True),
    ]
    async with running_cluster(emulator=make_emulator(*faults)) as cluster:
        await add_gpu_nodes(cluster)
        started = time.monotonic()
        await cluster.create(dlodeployment("wan", NS, SPEC))
        await cluster.wait(lambda: cluster.get("StatefulSet", NS, "wan"), what="StatefulSet")
        first_uid = cluster.get("StatefulSet", NS, "wan")["metadata"]["uid"]
        await cluster.wait(lambda: ready(cluster), timeout=30, what="Ready")
        seconds = time.monotonic() - started
        assert_converged(cluster)
        assert cluster.get("StatefulSet", NS, "wan")["metadata"]["uid"] == first_uid
        creates = [r for r in cluster.emulator if r.method.value == "POST" and r.resource is not None
                   and r.resource.plural in ("statefulsets", "services", "poddisruptionbudgets")]
        assert creates == []  # every write was an apply: the retry adopted the object, nothing was made twice
        assert all(f.fired == 1 for f in faults)
    figure("lost_answers", injected=len(faults), seconds_to_ready=seconds)


async def test_a_hung_api_call_times_out_and_status_keeps_refreshing():
    # An apply that never answers: without a client timeout the reconcile's thread waits for
    # ever and status stops moving.
    async with running_cluster(emulator=make_emulator(), kube_timeout=1.0) as cluster:
        emulator: FaultyEmulator = cluster.emulator  # type: ignore[assignment]
        # a spec change makes the next round apply the Services (an unchanged one is not sent again)
        await ready_then_hang(cluster, "PATCH", "services", {"service": {"port": 8080}})
        started = time.monotonic()
        # A pod turns unready (the emulated StatefulSet controller leaves Running pods alone).
        await cluster.call(cluster.kube.patch, "v1", "Pod", NS, "wan-1",
                           {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}]}})
        try:
            await cluster.wait(lambda: status_of(cluster).get("readyReplicas") == 1
                               and condition(cluster, "Ready")["status"] == "False", timeout=15, what="status refresh")
        finally:
            emulator.release.set()
        seconds = time.monotonic() - started
    figure("hung_call", client_timeout_s=1.0, seconds_to_status_refresh=seconds)


async def test_slow_api_every_operator_call_answered_late_still_converges():
    slow = Fault("*", "*", status=None, hang=0.3, times=10_000)
    async with running_cluster(emulator=make_emulator(slow), kube_timeout=5.0) as cluster:
        seconds = await create_and_wait_ready(cluster, timeout=60)
        assert_converged(cluster)
        assert slow.fired >= 5  # the first rounds' applies and status writes (an unchanged child is not sent again)
    figure("slow_api", delay_per_call_s=0.3, calls_delayed=slow.fired, seconds_to_ready=seconds)


async def test_late_stale_write_of_a_stopped_operator_is_undone():
    # Operator A's patch of the StatefulSet to spec v2 is held by the API server past A's client
    # timeout; A is replaced by B, the user moves on to v3 and B applies it; then the held v2
    # write lands. B must restore v3 by itself.
    async with running_cluster(emulator=make_emulator(), kube_timeout=2.0) as cluster:
        emulator: FaultyEmulator = cluster.emulator  # type: ignore[assignment]
        await ready_then_hang(cluster, "PATCH", "statefulsets", {"mode": "rank-local"})  # v2
        await cluster.stop_operator()  # A gives up on its call after its timeout; the server still holds it
        cluster.start_operator()
        await cluster.patch_dlod(NS, "wan", {"spec": {"mode": "allgather"}})  # v3

        def template_mode() -> str:
            return cluster.get("StatefulSet", NS, "wan")["spec"]["template"]["metadata"]["annotations"][builders.MODE_ANNOTATION]

        await cluster.wait(lambda: template_mode() == "allgather" and ready(cluster), timeout=30, what="v3 applied")
        left: list[str] = []
        emulator.on_landed = lambda: left.append(template_mode())
        emulator.release.set()  # A's stale v2 patch lands now
        # the stale state may last less than a poll: wait for the write itself, not for seeing it
        await cluster.wait(lambda: bool(emulator.landed), timeout=10, what="the stale write")
        assert left == ["rank-local"]  # it did write v2 back
        await cluster.wait(lambda: template_mode() == "allgather", timeout=10, what="v3 restored")
        restored = time.monotonic() - emulator.landed[0]
        await cluster.wait(lambda: ready(cluster) and status_of(cluster).get("mode") == "allgather", timeout=30,
                           what="Ready on v3")
        assert_converged(cluster)
    figure("stale_write", seconds_to_undo=restored)


async def test_operator_restart_mid_reconcile_converges_to_the_same_objects():
    # The first operator is stopped while its StatefulSet create hangs in the API server; the
    # Services and PDB it already made must be kept, not made again, and the late create of the
    # dead operator must not produce a second StatefulSet.
    hung_create = Fault("PATCH", "statefulsets", status=None, hang=600.0)
    async with running_cluster(emulator=make_emulator(hung_create), kube_timeout=2.0) as cluster:
        emulator: FaultyEmulator = cluster.emulator  # type: ignore[assignment]
        await add_gpu_nodes(cluster)
        await cluster.create(dlodeployment("wan", NS, SPEC))
        await cluster.wait(lambda: hung_create.fired, what="the operator mid-reconcile")
        assert cluster.get("StatefulSet", NS, "wan") is None
        made = {(k, n): cluster.get(k, NS, n)["metadata"]["uid"] for k, n in CHILDREN if k != "StatefulSet"}
        stopping = time.monotonic()
        await cluster.stop_operator()
        stop_seconds = time.monotonic() - stopping
        restarted = time.monotonic()
        cluster.start_operator()
        await cluster.wait(lambda: ready(cluster), timeout=30, what="Ready after the restart")
        restart_seconds = time.monotonic() - restarted
        emulator.release.set()  # the dead operator's create lands now: AlreadyExists
        await asyncio.sleep(3 * INTERVAL)
        assert_converged(cluster)
        assert {key: cluster.get(key[0], NS, key[1])["metadata"]["uid"] for key in made} == made

        # A second restart once converged: the resume handler writes nothing.
        versions = {(k, n): cluster.get(k, NS, n)["metadata"]["resourceVersion"] for k, n in CHILDREN}
        events_before = len(cluster.events_all())
        await cluster.stop_operator()
        cluster.start_operator()
        await asyncio.sleep(4 * INTERVAL)
        assert {(k, n): cluster.get(k, NS, n)["metadata"]["resourceVersion"] for k, n in CHILDREN} == versions
        new_events = [e.get("reason") for e in cluster.events_all()[events_before:]]
        assert not [r for r in new_events if r.endswith(("Created", "Patched", "Recreated"))], new_events
        assert_converged(cluster)
    figure("restart", seconds_to_stop=stop_seconds, seconds_to_ready_after_restart=restart_seconds)


INVALID: dict[str, tuple[dict[str, Any], str]] = {
    "bad-replicas": ({**SPEC, "replicas": -1}, "spec.replicas"),
    "bad-type": ({**SPEC, "devicesPerNode": "eight"}, "spec.devicesPerNode"),
    "unknown-field": ({**SPEC, "replica": 3}, "spec.replica"),
    "bad-mode": ({**SPEC, "mode": "fastest"}, "spec.mode"),
    "bad-threshold": ({**SPEC, "warmer": {"threshold": 2}}, "spec.warmer.threshold"),
    "no-model": ({"replicas": 1}, "spec.model"),
    "cel-rollout": ({**SPEC, "rollout": {"type": "Recreate", "maxUnavailable": 1}},
                    "only allowed with rollout.type RollingUpdate"),
    "cel-model": ({**SPEC, "model": {}}, "exactly one of model.path"),
}


async def test_invalid_resources_are_degraded_with_the_reason_and_nothing_is_built():
    # The emulator checks no schema: these reach the operator as they would from a CRD applied
    # without validation, or objects stored before a stricter version.
    async with running_cluster() as cluster:
        for name, (spec, _) in INVALID.items():
            await cluster.create(dlodeployment(name, NS, spec))

        def degraded(name: str) -> dict | None:
            c = condition(cluster, "Degraded", name)
            return c if c and c["status"] == "True" else None

        await cluster.wait(lambda: all(degraded(n) for n in INVALID), what="every resource Degraded")
        for name, (_, needle) in INVALID.items():
            c = degraded(name)
            assert c["reason"] == "InvalidSpec" and needle in c["message"], (name, c)
            assert condition(cluster, "Ready", name)["status"] == "False"
            assert status_of(cluster, name)["observedGeneration"] == 1
        assert not any(cluster.objects(k, NS) for k in ("StatefulSet", "Service", "PodDisruptionBudget"))
        await asyncio.sleep(3 * INTERVAL)  # timer rounds repeat no warning for an unchanged spec
        warnings = cluster.events("InvalidSpec")
        assert len(warnings) == len(INVALID), [e["involvedObject"]["name"] for e in warnings]
        assert all(e["type"] == "Warning" for e in warnings)
