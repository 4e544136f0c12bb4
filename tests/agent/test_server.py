"""dlo.agent.server: the agent metrics and profile over real HTTP."""

from __future__ import annotations

import json
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dlo.agent.modelcheck import REASONS
from dlo.plan.profile import NodeProfile
from dlo.agent.server import serve

from .conftest import AGENT_METRICS, MiB, get, make_agent, pods_for, samples, write_wan_folder


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


def _scrape(models_root: Path) -> tuple[str, str]:
    """One real HTTP round of a fresh agent over `models_root`: (/metrics text, /profile body)."""
    server = serve(make_agent(models_root), "127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        return get(base + "/metrics")[1], get(base + "/profile")[1]
    finally:
        server.shutdown()


def test_model_bytes_say_which_size_they_are(models_root: Path) -> None:
    """dlo_model_bytes is the whole folder, /profile models[].bytes the transformer: a second
    metric carries the transformer's size, and both help texts say which is which."""
    from prometheus_client.parser import text_string_to_metric_families

    from dlo.engine.blocks import describe

    text, body = _scrape(models_root)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    folder = models_root / "tiny-wan"
    whole = sum(f.stat().st_size for f in folder.rglob("*.safetensors"))
    transformer = describe(folder).bytes  # the transformer's tensor bytes (headers excluded)
    transformer_files = sum(f.stat().st_size for f in (folder / "transformer").glob("*.safetensors"))
    assert transformer <= transformer_files < whole  # the VAE makes the difference
    got = samples(text)
    assert got["dlo_model_bytes"] == [({"model": "tiny-wan"}, whole)]
    assert got["dlo_model_transformer_bytes"] == [({"model": "tiny-wan"}, transformer)]
    profile = NodeProfile.model_validate_json(body)
    assert profile.models["tiny-wan"].bytes == transformer
    assert "every file of the model folder" in families["dlo_model_bytes"].documentation
    assert "dlo_model_transformer_bytes" in families["dlo_model_bytes"].documentation
    assert "/profile models[].bytes" in families["dlo_model_transformer_bytes"].documentation
    # the profile's schema says the same (kubectl-style readers and `dlo plan --help` users)
    fields = NodeProfile.model_json_schema()["$defs"]["ModelProfile"]["properties"]
    assert "transformer only" in fields["bytes"]["description"] and "dlo_model_bytes" in fields["bytes"]["description"]


def _truncate(path: Path, by: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - by)


def test_a_broken_model_is_flagged_with_residency_unknown(models_root: Path) -> None:
    write_wan_folder(models_root / "cut")
    _truncate(models_root / "cut" / "transformer" / "diffusion_pytorch_model.safetensors", 100)
    text, body = _scrape(models_root)
    got = samples(text)
    errors = {(lab["model"], lab["reason"]): v for lab, v in got["dlo_model_error"]}
    assert errors == {(m, r): float(m == "cut" and r == "truncated") for m in ("cut", "tiny-wan") for r in REASONS}
    # residency and transformer size: unknown for the broken folder (absent), never 1.0
    assert [lab["model"] for lab, _ in got["dlo_model_page_cache_resident_ratio"]] == ["tiny-wan"]
    assert [lab["model"] for lab, _ in got["dlo_model_page_cache_resident_bytes"]] == ["tiny-wan"]
    assert [lab["model"] for lab, _ in got["dlo_model_transformer_bytes"]] == ["tiny-wan"]
    assert {lab["model"] for lab, _ in got["dlo_model_bytes"]} == {"cut", "tiny-wan"}  # what is on disk
    # /profile: the broken folder has no models entry (its facts are unknown) and a model_errors one
    doc = json.loads(body)
    assert set(doc["models"]) == {"tiny-wan"}
    assert doc["model_errors"]["cut"]["reason"] == "truncated"
    assert "diffusion_pytorch_model.safetensors" in doc["model_errors"]["cut"]["message"]
    # a reader of the contract's v1 shape still parses it (the field is optional and additive)
    NodeProfile.model_validate_json(body)
    healthy = make_agent(models_root.parent / "nothing-here")
    assert "model_errors" not in json.loads(healthy.profile().model_dump_json(exclude_none=True))


def test_metrics_answer_within_a_second_whatever_the_models_root_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many folders, huge sparse files (`truncate -s`) and broken files; the scan made slow on purpose
    (mincore instead of cachestat: it walks every page of a 128 GiB file). Scrapes during the first
    scan and after it answer within 1 s: the node loop scans, never the scrape."""
    import dlo.pagecache.residency as residency

    monkeypatch.setattr(residency, "_cachestat_works", False)
    root = tmp_path / "models"
    for i in range(120):
        write_wan_folder(root / f"m{i:03d}", blocks=2, dim=16)
    # a sound 128 GiB transformer (one sparse tensor) and a 64 GiB one cut short
    for name, size, cut in (("huge", 128 << 30, 0), ("huge-cut", 64 << 30, 1 << 30)):
        t = root / name
        t.mkdir(parents=True)
        (t / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel"}))
        n = size // 2
        header = json.dumps({"blocks.0.attn1.to_q.weight": {"dtype": "BF16", "shape": [n],
                                                             "data_offsets": [0, 2 * n]}}).encode()
        path = t / "diffusion_pytorch_model.safetensors"
        path.write_bytes(struct.pack("<Q", len(header)) + header)
        subprocess.run(["truncate", "-s", str(8 + len(header) + 2 * n - cut), str(path)], check=True)
    write_wan_folder(root / "bad-header")
    (root / "bad-header" / "vae" / "diffusion_pytorch_model.safetensors").write_bytes(
        struct.pack("<Q", 4) + b"nope")
    write_wan_folder(root / "no-config")
    (root / "no-config" / "transformer" / "config.json").unlink()

    agent = make_agent(root)
    server = serve(agent, "127.0.0.1", 0)
    stop = threading.Event()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    scrape_s: list[float] = []

    def scrape() -> str:
        start = time.monotonic()
        code, text = get(base + "/metrics")
        scrape_s.append(time.monotonic() - start)
        assert code == 200
        return text

    try:
        scan_start = time.monotonic()
        agent.start_model_loop(stop)
        during = 0
        while not agent.models_scanned.is_set():
            scrape()
            during += 1
            if time.monotonic() - scan_start > 120:
                raise AssertionError("the first scan did not finish in 120 s")
        scan_s = time.monotonic() - scan_start
        for _ in range(5):
            text = scrape()
        code, body = get(base + "/profile")
    finally:
        stop.set()
        server.shutdown()
    print(f"\nfirst scan of {len(list(root.iterdir()))} folders: {scan_s:.2f} s; {len(scrape_s)} scrapes "
          f"({during} during the scan): max {max(scrape_s) * 1000:.1f} ms, "
          f"median {sorted(scrape_s)[len(scrape_s) // 2] * 1000:.1f} ms")
    assert max(scrape_s) < 1.0
    got = samples(text)
    broken = {lab["model"]: lab["reason"] for lab, v in got["dlo_model_error"] if v == 1}
    assert broken == {"huge-cut": "truncated", "bad-header": "bad_header", "no-config": "no_config"}
    ratios = {lab["model"] for lab, _ in got["dlo_model_page_cache_resident_ratio"]}
    assert "huge" in ratios and len(ratios) == 121 and not ratios & set(broken)
    assert code == 200 and set(json.loads(body)["model_errors"]) == set(broken)


def _connect(port: int, source: str, data: bytes) -> "socket.socket":
    import socket

    s = socket.socket()
    s.settimeout(5)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    s.sendall(data)
    return s


def test_half_sent_heads_neither_hold_threads_nor_delay_health(models_root: Path) -> None:
    """A flood of connections that never finish their request head, from one address: beyond the
    per-address cap they get 503 at once, the rest are closed after the head timeout, no thread is
    spent on any of them, and /health from another address answers meanwhile."""
    import select
    import socket

    from dlo.agent.server import Limits

    server = serve(make_agent(models_root), "127.0.0.1", 0, Limits(max_connections=64, per_address=16,
                                                                   head_timeout_s=1.0))
    port = server.server_address[1]
    threads = threading.active_count()
    socks: list[socket.socket] = []
    try:
        socks = [_connect(port, "127.0.0.1", b"GET /metrics HTTP/1.1\r\nHost: x\r\n") for _ in range(100)]
        probe = _connect(port, "127.0.0.2", b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert probe.recv(4096).startswith(b"HTTP/1.1 200"), "a second address is not served during the flood"
        probe.close()
        assert threading.active_count() <= threads + 2, "connections hold threads"
        answers: dict[socket.socket, bytes] = {}
        deadline = time.monotonic() + 30
        while len(answers) < len(socks):  # every connection ends: refused at once, or closed by the timeout
            assert time.monotonic() < deadline, f"{len(socks) - len(answers)} connections still held"
            ready, _, _ = select.select([s for s in socks if s not in answers], [], [], 0.2)
            for s in ready:
                answers[s] = s.recv(4096)
        refused = [a for a in answers.values() if a.startswith(b"HTTP/1.1 503")]
        assert len(refused) == 100 - 16 and sum(1 for a in answers.values() if a == b"") == 16
    finally:
        for s in socks:
            s.close()
        server.shutdown()
