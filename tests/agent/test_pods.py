"""dlo.agent.pods: engine pods and their metrics endpoints, the node annotation."""

from __future__ import annotations

from dlo.agent.pods import scrape_pinned

from .conftest import MiB, V2_POD_A, make_agent


def test_scrape_pinned_sums_ranks_by_source(engine_url: str) -> None:
    # ranks 0 and 1 with an arena each, rank 2 registered
    assert scrape_pinned(engine_url) == {"arena": 2 * 1024 * MiB, "registered": 512 * MiB}


async def test_kubernetes_pods_and_node_annotation_against_an_api_emulator() -> None:
    """List this node's pods and patch only our annotation, over real HTTP (kmock's emulator)."""
    import asyncio

    import kmock

    from dlo.agent.pods import KubernetesPods

    def pod(name: str, uid: str, node: str, labels: dict[str, str]) -> dict:
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "serving", "uid": uid, "resourceVersion": "1", "labels": labels},
            "spec": {"nodeName": node, "containers": [
                {"name": "engine", "image": "dlo", "ports": [{"name": "http", "containerPort": 8123}]}]},
            "status": {"podIP": "10.1.2.3"},
        }

    engine_labels = {"app.kubernetes.io/part-of": "dlo", "app.kubernetes.io/component": "engine"}
    emulator = kmock.KubernetesEmulator()
    emulator.resources.load_bundled()
    async with emulator, kmock.Server(emulator):
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": "n1", "uid": "n1", "resourceVersion": "1", "annotations": {"keep": "me"}}}
        for path, body in [
            ("/api/v1/nodes", node),
            ("/api/v1/namespaces/serving/pods", pod("wan-0", V2_POD_A, "n1", engine_labels)),
            ("/api/v1/namespaces/serving/pods", pod("wan-1", "other-uid", "n2", engine_labels)),
        ]:
            async with emulator.request("POST", path, json=body) as r:
                assert r.status in (200, 201)
        api = KubernetesPods("n1", host=str(emulator.url))
        pods = await asyncio.to_thread(api.pods)
        assert [(p.name, p.uid, p.ip, p.http_port, p.is_engine) for p in pods] == [
            ("wan-0", V2_POD_A, "10.1.2.3", 8123, True)
        ]
        agent = make_agent(None, api)
        listed = await asyncio.to_thread(agent.pods)  # the emulator serves on this loop
        assert [t.url for t in agent.engine_targets(listed)] == ["http://10.1.2.3:8123"]
        await asyncio.to_thread(api.annotate_node, '{"version": "v1"}')
        async with emulator.request("GET", "/api/v1/nodes/n1") as r:
            annotations = (await r.json())["metadata"]["annotations"]
        assert annotations == {"keep": "me", "dlo.dev/node-profile": '{"version": "v1"}'}


async def test_pod_watch_keeps_the_nodes_pods_without_listing_per_scrape() -> None:
    """One listing, then the watch: a pod created or deleted later shows in `pods()` without another
    listing; pods of other nodes never do; scrapes read memory (real HTTP, kmock's emulator)."""
    import asyncio
    import threading

    import kmock

    from dlo.agent.podwatch import PodWatch
    from dlo.agent.pods import KubernetesPods
    from tests.engine.serving_helpers import wait_until

    def pod(name: str, node: str) -> dict:
        return {"apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": name, "namespace": "serving", "uid": f"uid-{name}", "resourceVersion": "1",
                             "labels": {"app.kubernetes.io/part-of": "dlo", "app.kubernetes.io/component": "engine"}},
                "spec": {"nodeName": node, "containers": [{"name": "engine", "image": "dlo"}]},
                "status": {"podIP": "10.1.2.3"}}

    emulator = kmock.KubernetesEmulator()
    emulator.resources.load_bundled()
    stop = threading.Event()
    async with emulator, kmock.Server(emulator):
        async def post(body: dict) -> None:
            async with emulator.request("POST", "/api/v1/namespaces/serving/pods", json=body) as r:
                assert r.status in (200, 201)

        await post(pod("wan-0", "n1"))
        await post(pod("other", "n2"))
        # the emulator never ends a watch: a short read timeout resumes it (and ends it at the close)
        watch = PodWatch(KubernetesPods("n1", host=str(emulator.url)), watch_seconds=30, read_timeout_s=1.0)
        watch.start(stop)
        names = lambda: [p.name for p in watch.pods()]  # noqa: E731
        await asyncio.to_thread(wait_until, lambda: names() == ["wan-0"], 20, "the listing is in")
        await post(pod("wan-1", "n1"))
        await post(pod("late", "n2"))
        await asyncio.to_thread(wait_until, lambda: names() == ["wan-0", "wan-1"], 20, "the watch adds wan-1")
        async with emulator.request("DELETE", "/api/v1/namespaces/serving/pods/wan-0") as r:
            assert r.status == 200
        await asyncio.to_thread(wait_until, lambda: names() == ["wan-1"], 20, "the watch removes wan-0")
        for _ in range(50):
            watch.pods()
        assert watch.listings == 1 and watch.synced.is_set()
        stop.set()
