"""High availability on the emulated cluster: two operator replicas with leader election on a Lease
(real kopf, real HTTP, each in its thread). The standby reads the lease and writes nothing; when the
leader dies (its lease left to expire, as a killed process does) or is cut off from the lease, the
standby takes over within 30 s, and no write of the old leader comes after the new one's first.
Deleting a DLODeployment never waits on an operator: the resource carries no finalizer."""

from __future__ import annotations

import time

import kmock

from cluster import Emulator, dlodeployment, running_cluster
from dlo.operator.handlers import KOPF_FINALIZER
from dlo.operator.leader import LEASE_API
from test_handlers import NS, SPEC, add_gpu_nodes, condition

WRITES = ("POST", "PUT", "PATCH", "DELETE")
TAKEOVER_S = 30.0


class Partition(Emulator):
    """Answers 503 to every request of the user agents in `cut` (a replica cut off from the API)."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.cut: set[str] = set()

    async def _handle(self, request):  # type: ignore[override]
        if request.headers.get("User-Agent") in self.cut:
            raise kmock.KubernetesError(status=503, reason="ServiceUnavailable", message="partitioned")
        return await super()._handle(request)


def holder(cluster) -> str:
    lease = cluster.get("Lease", "dlo-system", "dlo-operator", LEASE_API)
    return ((lease or {}).get("spec") or {}).get("holderIdentity") or ""


def requests(cluster) -> list[tuple[int, str, str, str]]:
    """(position, method, user agent, path) of every request the emulator saw, in order."""
    return [(i, r.method.value, r.headers.get("User-Agent", ""), str(r.url))
            for i, r in enumerate(cluster.emulator)]


def writes_of(cluster, agent: str) -> list[int]:
    return [i for i, method, ua, _ in requests(cluster) if ua == agent and method in WRITES]


def took_lease_at(cluster, identity: str) -> int:
    """The position of the lease write that made `identity` the holder (its first successful one)."""
    return min(i for i, method, ua, path in requests(cluster)
               if ua == f"dlo-operator-lease/{identity}" and method in ("POST", "PATCH") and "leases" in path)


def sts_replicas(cluster) -> int | None:
    return (cluster.get("StatefulSet", NS, "wan") or {}).get("spec", {}).get("replicas")


async def test_the_standby_takes_over_within_30_s_of_the_leaders_death_without_a_write_before():
    async with running_cluster(with_operator=False) as cluster:
        await add_gpu_nodes(cluster, count=3)
        cluster.start_operator("a")
        await cluster.wait(lambda: holder(cluster) == "a", what="a leads")
        cluster.start_operator("b")
        await cluster.create(dlodeployment("wan", NS, SPEC))
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
        await cluster.wait(lambda: any(ua == "dlo-operator-lease/b" for _, _, ua, _ in requests(cluster)), what="b stands by")
        assert writes_of(cluster, "dlo-operator/b") == [] and holder(cluster) == "a"
        await cluster.stop_operator("a", crash=True)  # killed: the lease is left to expire
        died = time.monotonic()
        await cluster.patch_dlod(NS, "wan", {"spec": {"replicas": 3}})  # while nobody leads
        await cluster.wait(lambda: sts_replicas(cluster) == 3, timeout=TAKEOVER_S, what="b applies the change")
        took_over = time.monotonic() - died
        assert holder(cluster) == "b"
        print(f"FIGURE failover seconds_to_apply_after_the_leaders_death={took_over:.1f}")
        taken = took_lease_at(cluster, "b")
        assert all(i > taken for i in writes_of(cluster, "dlo-operator/b"))  # no write before it led
        assert all(i < taken for i in writes_of(cluster, "dlo-operator/a"))  # none of the dead one's after
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True"
                           and (cluster.get("DLODeployment", NS, "wan")["status"].get("readyReplicas") == 3),
                           what="Ready on 3 replicas")


async def test_a_leader_cut_off_from_its_lease_stops_writing_before_the_standby_starts():
    """Fencing: the leader still sees the cluster but cannot renew; past its renew deadline (10 s)
    it refuses every write and stops, before the lease (15 s) lets the standby take over."""
    emulator = Partition()
    async with running_cluster(with_operator=False, emulator=emulator) as cluster:
        await add_gpu_nodes(cluster, count=3)
        a = cluster.start_operator("a")
        await cluster.wait(lambda: holder(cluster) == "a", what="a leads")
        cluster.start_operator("b")
        await cluster.create(dlodeployment("wan", NS, SPEC))
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
        emulator.cut.add("dlo-operator-lease/a")
        cut = time.monotonic()
        await cluster.wait(lambda: a.elector.fenced.is_set(), timeout=TAKEOVER_S, what="a fences itself")
        fenced = time.monotonic() - cut
        await cluster.patch_dlod(NS, "wan", {"spec": {"replicas": 3}})
        await cluster.wait(lambda: sts_replicas(cluster) == 3, timeout=TAKEOVER_S, what="b applies the change")
        took_over = time.monotonic() - cut
        print(f"FIGURE fencing seconds_to_fence={fenced:.1f} seconds_to_apply={took_over:.1f}")
        await cluster.wait(lambda: not a.thread.is_alive(), what="a stops")
        assert a.led is False  # `dlo operator run` exits non-zero: the pod restarts as a standby
        taken = took_lease_at(cluster, "b")
        assert all(i < taken for i in writes_of(cluster, "dlo-operator/a"))
        assert all(i > taken for i in writes_of(cluster, "dlo-operator/b"))
        assert holder(cluster) == "b" and fenced < 15.0  # before the lease could expire for b


async def test_deleting_a_dlodeployment_never_waits_on_an_operator():
    async with running_cluster() as cluster:
        await add_gpu_nodes(cluster, count=4)
        await cluster.create(dlodeployment("wan", NS, SPEC))
        old = dlodeployment("old", NS, SPEC)
        old["metadata"]["finalizers"] = [KOPF_FINALIZER]  # what earlier versions' kopf daemon added
        await cluster.create(old)
        await cluster.wait(lambda: (condition(cluster, "Ready") or {}).get("status") == "True", what="Ready")
        await cluster.wait(lambda: not cluster.get("DLODeployment", NS, "old")["metadata"].get("finalizers"),
                           what="kopf's old finalizer removed")
        assert not cluster.get("DLODeployment", NS, "wan")["metadata"].get("finalizers")
        await cluster.stop_operator()  # nothing runs now
        for name in ("wan", "old"):
            assert await cluster.delete_dlod(NS, name)
            assert cluster.get("DLODeployment", NS, name) is None  # gone at once, not Terminating
        await cluster.wait(lambda: not cluster.objects("StatefulSet", NS), what="children collected")
