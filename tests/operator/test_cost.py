"""What the operator's work grows with: the changes that concern a DLODeployment, not the fleet.
On the emulated cluster: node heartbeats wake no reconcile, a node's change wakes only the
DLODeployments it concerns, a steady round writes nothing, a StatefulSet another writer changed is
applied over at once. Pure: the reconcile reads the indexes' own dicts (no copy a round), and a
plan is asked once per node type and profile text, not once per node and round."""

from __future__ import annotations

import json

from cluster import dlodeployment, running_cluster
from dlo.operator import handlers, modes
from dlo.operator.models import parse_spec
from dlo.operator.node_index import NodeIndex
from test_handlers import NS, SPEC, condition, gpu_node_profile, status_of

POOLS = {"a": ("node-a0", "node-a1"), "b": ("node-b0", "node-b1")}
CHILD_KINDS = ("services", "statefulsets", "poddisruptionbudgets", "podmonitors")


def pooled(pool: str) -> dict:
    return {**SPEC, "placement": {"nodeSelector": {"pool": pool}}}


async def add_pools(cluster) -> None:
    for pool, names in POOLS.items():
        for name in names:
            await cluster.add_node(name, labels={"pool": pool}, annotations=gpu_node_profile(name, "h200-node.json"),
                                   allocatable={"nvidia.com/gpu": "8"})


BEATS = iter(range(1, 10**9))


async def heartbeat(cluster, name: str) -> None:
    """What a kubelet posts every 10 s: the Ready condition with a new lastHeartbeatTime (a time
    of its own each, so that every one is a write and an event)."""
    beat = next(BEATS)
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime":
             f"2026-01-01T{beat // 3600 % 24:02d}:{beat // 60 % 60:02d}:{beat % 60:02d}Z",
             "lastTransitionTime": "2026-01-01T00:00:00Z"}
    await cluster.call(cluster.kube.patch, "v1", "Node", None, name, {"status": {"conditions": [ready]}})


def all_ready(cluster) -> bool:
    return all((condition(cluster, "Ready", name) or {}).get("status") == "True" for name in POOLS)


async def test_heartbeats_wake_nothing_and_a_node_change_wakes_only_what_it_concerns():
    async with running_cluster(status_interval=600.0) as cluster:  # no resync within the test
        await add_pools(cluster)
        for pool in POOLS:
            await cluster.create(dlodeployment(pool, NS, pooled(pool)))
        await cluster.wait(lambda: all_ready(cluster), what="both Ready")
        memo = cluster.operators[""].memo
        names = [name for pool in POOLS.values() for name in pool]
        seen = {name: memo.node_index.seen[name] + 1 for name in names}
        for name in names:  # a node's first heartbeat adds its Ready condition: a change (once)
            await heartbeat(cluster, name)
        await cluster.wait(lambda: all(memo.node_index.seen[n] >= seen[n] for n in names), what="first heartbeats")
        woke = dict(memo.node_index.woke)
        for _ in range(5):
            for name in names:
                await heartbeat(cluster, name)
        await cluster.wait(lambda: all(memo.node_index.seen[n] >= seen[n] + 5 for n in names),
                           what="every heartbeat handled by the operator")
        assert dict(memo.node_index.woke) == woke  # 20 heartbeats, no DLODeployment woken
        rounds = dict(memo.loops.rounds)
        profile = json.loads(gpu_node_profile("node-a0", "h200-node.json")["dlo.dev/node-profile"])
        for entry in profile["models"].values():
            entry["resident_ratio"] = 0.5
        await cluster.call(cluster.kube.patch, "v1", "Node", None, "node-a0",
                           {"metadata": {"annotations": {"dlo.dev/node-profile": json.dumps(profile)}}})
        await cluster.wait(lambda: status_of(cluster, "a").get("cachedRatio") == 0.5, what="a reports the change")
        assert memo.loops.rounds[(NS, "a")] > rounds[(NS, "a")]
        assert memo.node_index.woke[(NS, "a")] == woke[(NS, "a")] + 1
        assert memo.node_index.woke[(NS, "b")] == woke.get((NS, "b"), 0)  # pool b's: not its node


async def test_a_steady_round_writes_nothing_and_a_changed_statefulset_is_applied_over():
    async with running_cluster() as cluster:  # a resync every second
        await add_pools(cluster)
        await cluster.create(dlodeployment("a", NS, pooled("a")))
        await cluster.wait(lambda: (condition(cluster, "Ready", "a") or {}).get("status") == "True", what="Ready")
        memo = cluster.operators[""].memo
        before = len(list(cluster.emulator))
        rounds = memo.loops.rounds[(NS, "a")]
        await cluster.wait(lambda: memo.loops.rounds[(NS, "a")] >= rounds + 3, what="three resyncs")
        writes = [r for r in list(cluster.emulator)[before:] if r.method.value in ("PATCH", "POST", "PUT", "DELETE")
                  and r.resource is not None and r.resource.plural in CHILD_KINDS]
        assert writes == []  # the children are as the last apply left them: nothing sent again
        # another writer changes the StatefulSet: its watch wakes the owner, which applies it over
        await cluster.call(cluster.kube.patch, "apps/v1", "StatefulSet", NS, "a", {"spec": {"replicas": 1}})
        await cluster.wait(lambda: cluster.get("StatefulSet", NS, "a")["spec"]["replicas"] == 2,
                           timeout=5, what="the StatefulSet applied over")


def test_the_reconcile_reads_the_indexes_own_summaries():
    """A round's View holds the node index's dicts themselves: no copy of the inventory a round."""
    index = NodeIndex()
    for i in range(3):
        index.record(f"n{i}", {"metadata": {"name": f"n{i}", "labels": {}}, "spec": {}, "status": {}})
        assert index.changed(f"n{i}") is not None  # a new node is a change
    assert all(a is b for a, b in zip(index.values(), index.nodes.values()))
    same = dict(index.nodes["n0"])
    index.record("n0", same)  # an unchanged summary keeps the stored one: no change, nothing to wake
    assert index.changed("n0") is None and index.nodes["n0"] is not same
    assert handlers._node_summary({"metadata": {"name": "n"}, "status": {"conditions": [
        {"type": "Ready", "status": "True", "lastHeartbeatTime": "t1", "lastTransitionTime": "t0"}]}}) == \
        handlers._node_summary({"metadata": {"name": "n"}, "status": {"conditions": [
            {"type": "Ready", "status": "True", "lastHeartbeatTime": "t2", "lastTransitionTime": "t0"}]}})


def test_a_plan_is_asked_once_per_node_type_and_a_profile_parsed_once(monkeypatch):
    """500 eligible nodes of two types, planned three times (three rounds, or three DLODeployments
    alike): the plan is asked twice (once a type) and each profile text parsed once."""
    from dlo.plan import deployment
    from dlo.plan.profile import NodeProfile

    asked, parsed = [], []
    real_plan, real_parse = deployment.plan, NodeProfile.from_annotation
    monkeypatch.setattr(deployment, "plan", lambda *a, **k: asked.append(1) or real_plan(*a, **k))
    monkeypatch.setattr(NodeProfile, "from_annotation", classmethod(lambda cls, v: parsed.append(1) or real_parse(v)))
    modes.parsed_profile.cache_clear()
    modes._node_type.cache_clear()
    modes._CACHE.clear()
    nodes = [{"metadata": {"name": f"node-{i:03d}", "labels": {}, "annotations": gpu_node_profile(
        "x", "h200-node.json" if i % 2 else "l4-node.json")}, "spec": {}, "status": {"allocatable": {
            "nvidia.com/gpu": "8"}}} for i in range(500)]
    spec = parse_spec({**SPEC, "mode": "auto"})
    answers = {modes.resolve_mode(spec, nodes).mode for _ in range(3)}
    memory = {modes.pod_memory_bytes(spec, nodes, "allgather") for _ in range(3)}
    assert len(answers) == 1 and len(memory) == 1
    assert len(asked) == 2 and len(parsed) == 2
