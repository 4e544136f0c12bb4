"""`dlo serve`'s start fails fast and says why (serving/cli.py, service.py, rendezvous.py): a
port in use is refused before any rank starts; a key no client could send is refused at start;
a start that hangs (a rank that never answers) turns /health unhealthy after --startup-timeout;
and nothing of the weight plane or the control plane listens beyond loopback."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import psutil
import pytest
import requests

from dlo.serving.launch import ServerProcess
from tests.engine.serving_helpers import offline_env, tiny_pipeline, wait_until

pytestmark = pytest.mark.slow


def _serve_cli(model, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dlo.cli.main", "serve", str(model), "--device", "cpu",
                           "--small-limits", "--dp", "2", "--mode", "allgather", *args], capture_output=True,
                          text=True, env={**offline_env(), **(env or {})}, timeout=timeout)


def _one_line(r: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("dlo serve:")]
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    return lines[0]


def test_a_port_in_use_is_refused_before_any_rank_starts(tmp_path_factory):
    model = tiny_pipeline(tmp_path_factory, "wan")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        r = _serve_cli(model, "--port", str(taken.getsockname()[1]))
    finally:
        taken.close()
    assert "cannot listen there" in _one_line(r) and "rank1" not in r.stderr  # no child rank ever ran


def test_a_port_in_use_is_refused_at_once_before_the_folder_is_read(tmp_path):
    """The port is the first thing `dlo serve` takes: with it in use, a folder that is no model is
    not even read (its error would come first otherwise), and nothing else is printed."""
    (tmp_path / "not-a-model").mkdir()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        r = _serve_cli(tmp_path / "not-a-model", "--port", str(taken.getsockname()[1]))
    finally:
        taken.close()
    assert "cannot listen there: Address already in use" in _one_line(r) and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize("flags,env,message", [
    (["--device", "cuda"], {"CUDA_VISIBLE_DEVICES": ""},
     "dlo serve: --device cuda: no cuda device is visible to this process (torch.cuda.device_count() is 0; "
     "CUDA_VISIBLE_DEVICES=''); use --device cpu or auto"),
    (["--limits", "MISSING"], {}, "dlo serve: --limits MISSING: no such file"),
])
def test_a_start_that_cannot_run_says_why_in_one_line(tmp_path_factory, tmp_path, flags, env, message):
    model = tiny_pipeline(tmp_path_factory, "wan")
    missing = str(tmp_path / "limits.json")
    r = _serve_cli(model, *[missing if f == "MISSING" else f for f in flags], "--port", "0", env=env)
    assert _one_line(r) == message.replace("MISSING", missing)


def test_a_key_no_client_can_send_is_refused_at_start(tmp_path_factory):
    model = tiny_pipeline(tmp_path_factory, "wan")
    r = _serve_cli(model, env={"DLO_API_KEY": "cl\u00e9"})
    assert "DLO_API_KEY" in _one_line(r) and "printable ASCII" in r.stderr


def _children(srv: ServerProcess) -> list[psutil.Process]:
    assert srv.proc is not None
    return psutil.Process(srv.proc.pid).children(recursive=True)


def _status(srv: ServerProcess, path: str) -> int:
    try:
        return srv.get(path, timeout=5)[0]
    except OSError:  # not listening yet
        return 0


def test_a_start_that_hangs_turns_health_unhealthy_after_the_startup_timeout(tmp_path_factory, tmp_path):
    model = tiny_pipeline(tmp_path_factory, "wan")
    srv = ServerProcess(model, "--dp", "2", "--mode", "allgather", "--device", "cpu", "--small-limits",
                        "--startup-timeout", "5", log_path=tmp_path / "serve.log")
    srv.proc = subprocess.Popen(srv.cmd, env=srv.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        wait_until(lambda: _children(srv), 60, "the child rank is spawned", poll_s=0.01)
        for child in _children(srv):
            child.send_signal(signal.SIGSTOP)  # it never answers: the start hangs
        wait_until(lambda: _status(srv, "/health") == 503, 60, "/health is unhealthy after the startup deadline")
        body = requests.get(srv.url + "/health", timeout=5).json()
        assert body["status"] == "unhealthy" and "still loading" in body["reason"] and "--startup-timeout" in body["reason"]
        assert _status(srv, "/ready") == 503
    finally:
        for child in _children(srv):
            child.send_signal(signal.SIGCONT)
        srv.stop(timeout=10)


def test_nothing_but_loopback_listens(tmp_path_factory, tmp_path):
    model = tiny_pipeline(tmp_path_factory, "wan")
    with ServerProcess(model, "--dp", "2", "--mode", "allgather", "--device", "cpu", "--small-limits",
                       log_path=tmp_path / "serve.log") as srv:
        listening = []
        assert srv.proc is not None
        for p in [psutil.Process(srv.proc.pid), *_children(srv)]:
            listening += [(p.pid, c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN]
        assert listening, "nothing listens at all?"
        assert all(ip in ("127.0.0.1", "::1") for _, ip, _ in listening), listening
