"""dlo.agent.exporter: the agent metrics over real HTTP, engine scraping, profile publishing."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dlo.agent.exporter import Agent, AgentConfig, PodInfo, publish_loop, scrape_pinned, serve
from dlo.agent.profile import Accelerator, NodeProfile
from dlo.agent.topology import Devices

FIXTURES = Path(__file__).parent / "fixtures"
V2 = FIXTURES / "v2"
V2_POD_A = "1a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"  # a DLO engine pod below
V2_POD_B = "6f5e4d3c-2b1a-4f9e-8d7c-6b5a4f3e2d1c"  # some other workload
MiB = 1 << 20

AGENT_METRICS = {
    "dlo_node_memory_bytes", "dlo_pod_cgroup_memory_bytes", "dlo_pod_pss_bytes", "dlo_pod_host_pinned_bytes",
    "dlo_node_cgroup_invisible_bytes", "dlo_model_bytes", "dlo_model_page_cache_resident_bytes",
    "dlo_model_page_cache_resident_ratio", "dlo_warm_duration_seconds", "dlo_warm_runs",
    "dlo_node_profile_info",
}
H200 = Devices(Accelerator(vendor="nvidia", model="NVIDIA H200", count=8, memory_bytes=150 << 30), "nvlink", None)


class StaticPods:
    """The pods of one node, as the API would list them."""

    def __init__(self, pods: list[PodInfo]):
        self._pods = pods

    def pods(self) -> list[PodInfo]:
        return list(self._pods)


RANK_FACTS = {
    0: {"report": {"weights_source": "arena", "host_pinned_bytes": 1024 * MiB}},
    1: {"report": {"weights_source": "arena", "host_pinned_bytes": 1024 * MiB}},
    2: {"report": {"weights_source": "registered", "host_pinned_bytes": 512 * MiB}},
}


@pytest.fixture
def engine_url() -> Iterator[str]:
    """A real HTTP endpoint serving the engine's own exposition (dlo.engine.serving.metrics) for 3 ranks."""
    from dlo.engine.serving.metrics import EngineMetrics

    body = EngineMetrics(dp=3, rank_facts=lambda: RANK_FACTS).exposition()

    class H(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body if self.path == "/metrics" else b"")

        def log_message(self, *a: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def pods_for(engine_url: str) -> StaticPods:
    host, port = engine_url.removeprefix("http://").split(":")
    labels = {"app.kubernetes.io/part-of": "dlo", "app.kubernetes.io/component": "engine"}
    return StaticPods([
        PodInfo(V2_POD_A, "serving", "wan-0", host, labels, int(port)),
        PodInfo(V2_POD_B, "other", "batch-job", "10.0.0.9", {"app": "batch"}, None),
    ])


def make_agent(models_root: Path | None, pods: StaticPods | None = None, **kw: object) -> Agent:
    cfg = AgentConfig(node_name="n1", models_root=models_root, proc_root=V2 / "proc", cgroup_root=V2 / "cgroup", **kw)
    return Agent(cfg, devices=H200, pods=pods)


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        out.setdefault(fam.name, [])
        for s in fam.samples:
            out[fam.name].append((s.labels, s.value))
    return out


def test_scrape_pinned_sums_ranks_by_source(engine_url: str) -> None:
    # ranks 0 and 1 with an arena each, rank 2 registered
    assert scrape_pinned(engine_url) == {"arena": 2 * 1024 * MiB, "registered": 512 * MiB}


def test_metrics_endpoint_serves_every_agent_metric_with_contract_labels(models_root: Path, engine_url: str) -> None:
    agent = make_agent(models_root, pods_for(engine_url))
    server = serve(agent, "127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        agent.warm_models()
        code, text = get(base + "/metrics")
    finally:
        server.shutdown()
    assert code == 200
    got = samples(text)
    assert AGENT_METRICS <= set(got)
    # pod memory: only the DLO pod, named by the API, every contract kind from the v2 tree
    cg = {(lab["namespace"], lab["pod"], lab["kind"]): v for lab, v in got["dlo_pod_cgroup_memory_bytes"]}
    assert {k[:2] for k in cg} == {("serving", "wan-0")}
    assert cg[("serving", "wan-0", "usage")] == 1500 * MiB
    assert cg[("serving", "wan-0", "file_mapped")] == 900 * MiB
    assert {k[2] for k in cg} == {"usage", "peak", "anon", "file", "shmem", "file_mapped", "kernel"}
    assert got["dlo_pod_pss_bytes"] == [({"namespace": "serving", "pod": "wan-0"}, (400_000 + 200_000) * 1024)]
    pinned = {lab["source"]: v for lab, v in got["dlo_pod_host_pinned_bytes"]}
    assert pinned == {"arena": 2 * 1024 * MiB, "registered": 512 * MiB}
    assert got["dlo_node_cgroup_invisible_bytes"] == [({}, 5 * 1024 * MiB)]
    node = {lab["kind"]: v for lab, v in got["dlo_node_memory_bytes"]}
    assert node == {"total": 16 << 30, "available": 12 << 30, "page_cache": 3 << 30, "mlocked": 1 << 20}
    assert [lab["model"] for lab, _ in got["dlo_model_bytes"]] == ["tiny-wan"]
    assert got["dlo_model_page_cache_resident_ratio"][0][1] == pytest.approx(1.0)
    info = got["dlo_node_profile_info"][0][0]
    assert info == {"accelerator": "NVIDIA H200", "count": "8", "interconnect": "nvlink",
                    "can_register_page_cache": "true"}


def test_outside_kubernetes_pods_are_labelled_by_uid(models_root: Path) -> None:
    agent = make_agent(models_root)
    from prometheus_client import generate_latest

    from dlo.agent.exporter import make_registry

    got = samples(generate_latest(make_registry(agent)).decode())
    pods = {lab["pod"] for lab, _ in got["dlo_pod_cgroup_memory_bytes"]}
    assert V2_POD_A in pods and V2_POD_B in pods
    assert {lab["namespace"] for lab, _ in got["dlo_pod_cgroup_memory_bytes"]} == {""}


def test_agent_warming_is_counted(models_root: Path) -> None:
    agent = make_agent(models_root, warm_threshold=0.99)
    (m,) = agent.models(fresh=True)
    for f in m.path.rglob("*.safetensors"):
        import os

        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    agent.warm_models()
    agent.warm_models()  # resident now: no second warm
    rec = agent.warm_records["tiny-wan"]
    assert rec.runs["ok"] == 1 and rec.seconds is not None
    assert agent.models()[0].resident_bytes == agent.models()[0].files_bytes


def test_promtool_check_metrics_is_clean(models_root: Path, engine_url: str) -> None:
    from prometheus_client import generate_latest

    from dlo.agent.exporter import make_registry

    agent = make_agent(models_root, pods_for(engine_url))
    agent.warm_models()
    text = generate_latest(make_registry(agent))
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make test` installs Debian's prometheus package"
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True)
    assert proc.returncode == 0 and proc.stdout.strip() == b"" and proc.stderr.strip() == b"", proc


def test_profile_and_health_endpoints(models_root: Path) -> None:
    fragment = models_root.parent / "cal.json"
    fragment.write_text(json.dumps({"h2d_bandwidth_bps": 50_000_000_000}))
    agent = make_agent(models_root, calibration=fragment)
    server = serve(agent, "127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        code, body = get(base + "/profile")
        assert code == 200
        p = NodeProfile.model_validate_json(body)
        assert p.node == "n1" and p.measured and p.h2d_bandwidth_bps == 50_000_000_000
        assert p.interconnect.collective_bandwidth_bps == 360_000_000_000  # nominal, not calibrated
        assert set(p.models) == {"tiny-wan"}
        assert p.host_memory_bytes == 16 << 30  # from the fixture /proc
        assert get(base + "/health") == (200, "ok\n")
        assert get(base + "/nope")[0] == 404
    finally:
        server.shutdown()


def test_bad_calibration_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "cal.json"
    bad.write_text('{"h2d_bandwidth_bps": -1}')
    with pytest.raises(ValueError, match="calibration fragment"):
        make_agent(None, calibration=bad)


def test_publish_loop_patches_only_when_the_profile_changes(models_root: Path) -> None:
    agent = make_agent(models_root)
    patches: list[str] = []
    stop = threading.Event()

    def annotate(value: str) -> None:
        patches.append(value)
        if len(patches) == 1:
            (models_root / "tiny-wan").rename(models_root / "renamed")  # the profile changes
            agent.models(fresh=True)
        if len(patches) == 2:
            stop.set()

    def failing_then_ok(value: str) -> None:
        if not hasattr(failing_then_ok, "failed"):
            failing_then_ok.failed = True  # type: ignore[attr-defined]
            raise RuntimeError("API unavailable")
        annotate(value)

    t = threading.Thread(target=publish_loop, args=(agent, failing_then_ok, stop, 0.01))
    t.start()
    t.join(timeout=10)
    assert not t.is_alive()
    assert len(patches) == 2
    assert set(NodeProfile.from_annotation(patches[0]).models) == {"tiny-wan"}
    assert set(NodeProfile.from_annotation(patches[1]).models) == {"renamed"}


def test_unreachable_engine_and_pod_listing_failure_do_not_fail_the_scrape(models_root: Path) -> None:
    class Broken:
        def pods(self) -> list[PodInfo]:
            raise ConnectionError("API down")

    agent = make_agent(models_root, Broken(), engine_urls=["http://127.0.0.1:9"])
    from prometheus_client import generate_latest

    from dlo.agent.exporter import make_registry

    got = samples(generate_latest(make_registry(agent)).decode())
    assert got["dlo_pod_host_pinned_bytes"] == []
    assert got["dlo_node_memory_bytes"]


async def test_kubernetes_pods_and_node_annotation_against_an_api_emulator() -> None:
    """List this node's pods and patch only our annotation, over real HTTP (kmock's emulator)."""
    import asyncio

    import kmock

    from dlo.agent.exporter import KubernetesPods

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


def test_pod_listing_is_cached_and_survives_an_api_outage(models_root: Path) -> None:
    calls: list[int] = []

    class Flaky:
        def pods(self) -> list[PodInfo]:
            calls.append(1)
            if len(calls) > 1:
                raise ConnectionError("API down")
            return [PodInfo(V2_POD_A, "serving", "wan-0", None, {"app.kubernetes.io/part-of": "dlo"}, None)]

    agent = make_agent(models_root, Flaky(), pods_ttl_s=0.0)
    first = agent.pods()
    assert agent.pods() == first and len(calls) == 2  # outage: the last answer stands
    cached = make_agent(models_root, Flaky(), pods_ttl_s=60.0)
    calls.clear()
    cached.pods()
    cached.pods()
    assert len(calls) == 1
