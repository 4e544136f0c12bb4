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


def test_residency_bands_floor_and_keep_full_and_unknown() -> None:
    from dlo.agent.node import band_residency

    assert [band_residency(r) for r in (None, 1.0, 0.0, 0.5049, 0.9899, 0.99, 0.9957, 0.99999)] == [
        None, 1.0, 0.0, 0.5, 0.98, 0.99, 0.995, 0.999]


def test_a_small_move_of_residency_leaves_the_published_profile_alone(tmp_path: Path) -> None:
    """A few pages evicted change the measured residency but not the annotation (no patch); half the
    model evicted changes it."""
    import os

    from dlo.agent.node import published_profile
    from .conftest import write_safetensors

    root = tmp_path / "models"
    folder = write_wan_folder(root / "big")
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    size = write_safetensors(weights, {"blocks.0.attn1.to_q.weight": ("BF16", [2048, 2048]),
                                       "blocks.0.norm2.weight": ("F32", [2048])})
    agent = make_agent(root, models_ttl_s=0.0)
    fd = os.open(weights, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # page by page: no readahead, no large folios
        for offset in range(0, int(size * 0.555), 4096):  # mid-band: about 55.5 % of the model resident
            os.pread(fd, 4096, offset)

        def measured_and_published() -> tuple[float, str]:
            profile = agent.profile()
            return profile.models["big"].resident_ratio or 0.0, published_profile(profile).to_annotation()

        ratio0, value0 = measured_and_published()
        assert 0.3 < ratio0 < 0.7
        os.posix_fadvise(fd, 1 << 20, 8 * 4096, os.POSIX_FADV_DONTNEED)  # 8 pages: ~0.4 %
        ratio1, value1 = measured_and_published()
        assert ratio1 < ratio0 and value1 == value0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        ratio2, value2 = measured_and_published()
        assert ratio2 < 0.1 and value2 != value0
    finally:
        os.close(fd)
