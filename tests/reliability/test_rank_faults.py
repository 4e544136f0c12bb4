"""Rank faults in `dlo serve`: a killed or stalled rank fails its wave with 503 within the progress
timeout, the server turns unhealthy and exits non-zero, and nothing is left behind (processes,
/dev/shm segments). A long wave that keeps progressing is never cut."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

from dlo.engine.launch import ServerProcess
from tests.engine.serving_helpers import tiny_pipeline

pytestmark = pytest.mark.slow

PROGRESS_TIMEOUT = 3.0
LONG = {"prompt": "a long one", "size": "128x128", "num_inference_steps": 1200, "seed": 5}


@pytest.fixture(scope="module")
def long_limits(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("limits") / "limits.json"
    path.write_text(json.dumps({"max_steps": 1200, "max_width": 128, "max_height": 128, "max_sequence_length": 32}))
    return path


def _server(tmp_path_factory, tmp_path, limits: Path) -> ServerProcess:
    model = tiny_pipeline(tmp_path_factory, "wan")
    return ServerProcess(model, "--dp", "2", "--mode", "allgather", "--device", "cpu", "--limits", str(limits),
                         "--progress-timeout", str(PROGRESS_TIMEOUT), log_path=tmp_path / "serve.log")


def _post_in_thread(srv: ServerProcess, body: dict) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            r = requests.post(srv.url + "/v1/images/generations", json=body, timeout=120)
            out.update(status=r.status_code, body=r.json(), at=time.monotonic())
        except requests.RequestException as e:
            out.update(status=None, error=repr(e), at=time.monotonic())

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _wait_for_steps(srv: ServerProcess, pid: int, seconds: float = 30) -> None:
    """Until the wave is busy: rank 0 has burnt CPU on the request (no step metric exists mid-wave)."""
    proc = psutil.Process(pid)
    start = sum(proc.cpu_times()[:2])
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and sum(proc.cpu_times()[:2]) - start < 1.0:
        time.sleep(0.1)


def test_a_wave_longer_than_the_progress_timeout_completes(tmp_path_factory, tmp_path, long_limits):
    srv = _server(tmp_path_factory, tmp_path, long_limits)
    with srv:
        t0 = time.monotonic()
        r = requests.post(srv.url + "/v1/images/generations", json=LONG, timeout=300)
        took = time.monotonic() - t0
        assert r.status_code == 200, r.text[:300]
        assert took > PROGRESS_TIMEOUT, f"the request took {took:.1f} s: too short to prove anything"
        assert requests.get(srv.url + "/health").status_code == 200
    assert srv.proc is not None and srv.proc.returncode == 0


@pytest.mark.parametrize("fault", ["kill", "stall"])
def test_rank_fault_fails_the_wave_with_503_and_the_server_exits_cleanly(tmp_path_factory, tmp_path, long_limits,
                                                                          fault):
    shm_before = _shm()
    srv = _server(tmp_path_factory, tmp_path, long_limits)
    srv.start()
    assert srv.proc is not None
    try:
        server = psutil.Process(srv.proc.pid)
        tree = [server, *server.children(recursive=True)]
        ranks = [p for p in tree if p.pid != srv.proc.pid]
        assert len(ranks) == 1, f"expected one child rank, found {[p.cmdline() for p in ranks]}"
        victim = ranks[0]
        thread, out = _post_in_thread(srv, LONG)
        _wait_for_steps(srv, srv.proc.pid)
        assert "status" not in out, f"the long request finished before the fault: {out}"
        t_fault = time.monotonic()
        victim.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        thread.join(60)
        assert not thread.is_alive(), "the request hung after the fault"
        assert out["status"] == 503, out
        err = out["body"]["error"]
        assert "rank 1" in err["message"] and err["code"] == "engine_failed", err
        if fault == "stall":
            assert "no progress" in err["message"]
        assert out["at"] - t_fault < PROGRESS_TIMEOUT + 5, f"503 came {out['at'] - t_fault:.1f} s after the fault"
        # unhealthy until it exits, and it exits non-zero
        health = None
        try:
            health = requests.get(srv.url + "/health", timeout=5).status_code
        except requests.ConnectionError:
            pass  # already gone
        assert health in (None, 503)
        assert srv.wait_exit(timeout=30) != 0
    finally:
        srv.stop(timeout=5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree):
        time.sleep(0.1)
    left = [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"orphan processes: {left}"
    assert _shm() - shm_before == set(), "leaked /dev/shm segments"
