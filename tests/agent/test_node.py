"""dlo.agent.node: the node agent's sources, caches, warming and profile publishing."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from dlo.agent.node import publish_loop
from dlo.agent.pods import PodInfo
from dlo.plan.profile import NodeProfile

from .conftest import V2_POD_A, make_agent, write_wan_folder


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


def truncate_weights(folder: Path, by: int = 100) -> None:
    path = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - by)


def test_a_broken_model_is_logged_once_per_change_of_state(models_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    agent = make_agent(models_root)
    caplog.set_level(logging.INFO, logger="dlo.agent.node")

    def lines(level: int) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "dlo.agent.node" and r.levelno == level]

    agent.scan_models()
    assert not lines(logging.WARNING)
    truncate_weights(models_root / "tiny-wan")
    for _ in range(3):  # three scans (three scrape intervals) of the same broken state: one line
        agent.scan_models()
    (warning,) = lines(logging.WARNING)
    assert "model broken model=tiny-wan reason=truncated" in warning
    assert agent.model_errors["tiny-wan"].reason == "truncated"
    (models_root / "tiny-wan" / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    agent.scan_models()
    agent.scan_models()
    assert len(lines(logging.WARNING)) == 2 and "reason=missing_shard" in lines(logging.WARNING)[1]
    write_wan_folder(models_root / "tiny-wan")  # repaired
    agent.scan_models()
    agent.scan_models()
    assert len(lines(logging.WARNING)) == 2
    assert lines(logging.INFO).count("model no longer broken model=tiny-wan") == 1
    assert agent.model_errors == {}


def test_with_the_node_loop_running_reads_never_scan(models_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import dlo.agent.node as node

    agent = make_agent(models_root, models_ttl_s=0.05)
    scans: list[threading.Thread] = []
    real = node.model_folders

    def counted(root: Path | None):  # type: ignore[no-untyped-def]
        scans.append(threading.current_thread())
        return real(root)

    monkeypatch.setattr(node, "model_folders", counted)
    stop = threading.Event()
    loop = agent.start_model_loop(stop)
    try:
        assert agent.models_scanned.wait(10)
        for _ in range(20):
            assert [m.name for m in agent.models()] == ["tiny-wan"]
            agent.profile()
        deadline = time.monotonic() + 10
        while len(scans) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(scans) >= 3  # the loop rescans every models_ttl_s ...
        assert set(scans) == {loop}  # ... and only the loop does
    finally:
        stop.set()
        loop.join(timeout=10)


def _hostile_folders(root: Path, deep_tree: Callable[..., Path]) -> None:
    """Beside a sound folder: one whose config's `architectures` is an integer, one whose tree is
    deeper than a recursive walk goes (each used to make the whole scan raise)."""
    import json

    write_wan_folder(root / "badcfg")
    (root / "badcfg" / "transformer" / "config.json").write_text(json.dumps({"architectures": 5}))
    deep_tree(write_wan_folder(root / "deep") / "transformer" / "deep")


def test_one_bad_folder_is_flagged_and_every_other_keeps_its_series(models_root: Path, deep_tree) -> None:
    from dlo.agent.collector import make_registry
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    _hostile_folders(models_root, deep_tree)
    agent = make_agent(models_root)
    stop = threading.Event()
    try:
        agent.start_model_loop(stop)
        patches: list[str] = []

        def annotate(value: str) -> None:
            patches.append(value)
            stop.set()

        t = threading.Thread(target=publish_loop, args=(agent, annotate, stop, 0.01), daemon=True)
        t.start()
        t.join(timeout=30)
    finally:
        stop.set()
    assert patches, "the node annotation was never published"
    published = NodeProfile.from_annotation(patches[0])
    assert set(published.models) == {"tiny-wan"}
    assert {n: e.reason for n, e in (published.model_errors or {}).items()} == {"badcfg": "bad_config",
                                                                               "deep": "scan_error"}
    text = generate_latest(make_registry(agent)).decode()
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    assert {s.labels["model"] for s in samples if s.name == "dlo_model_page_cache_resident_bytes"} == {"tiny-wan"}
    assert {(s.labels["model"], s.labels["reason"]) for s in samples if s.name == "dlo_model_error" and s.value == 1} \
        == {("badcfg", "bad_config"), ("deep", "scan_error")}
