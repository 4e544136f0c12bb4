"""Connection floods against `dlo serve` (its RLIMIT_NOFILE set low in the child process): the cap
answers connections beyond `--max-connections` with a 503 JSON at once, silent connections are
closed after `--idle-timeout`, running out of descriptors logs one line per episode (never one per
failed accept: asyncio alone wrote ~4,000 lines a second), and the server serves again once the
flood's connections close. Every wait is for a state with a deadline."""

from __future__ import annotations

import json
import select
import socket
import time
from pathlib import Path

import pytest
import requests

from dlo.serving.connections import PROBE_RESERVE
from dlo.serving.launch import ServerProcess
from tests.engine.serving_helpers import tiny_pipeline, wait_until
from tests.reliability.figures import record

pytestmark = pytest.mark.slow

NOFILE = 512
FLOOD = 400
MAX_LOG_LINES = 60  # for the whole flood; without the guard: tens of thousands


def _lines(path: Path) -> int:
    return sum(1 for _ in path.open("rb"))


def _connect_all(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        try:
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            break
    return socks


def _serves(srv: ServerProcess) -> bool:
    try:
        return requests.get(srv.url + "/health", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def _server(tmp_path_factory, log: Path, *args: str) -> ServerProcess:
    model = tiny_pipeline(tmp_path_factory, "wan")
    return ServerProcess(model, "--dp", "1", "--mode", "resident", "--device", "cpu", "--small-limits", *args,
                         log_path=log, nofile=NOFILE)


def test_the_cap_refuses_with_503_json_and_idle_connections_are_closed(tmp_path_factory, tmp_path):
    log = tmp_path / "serve.log"
    idle = 2.0
    with _server(tmp_path_factory, log, "--idle-timeout", str(idle)) as srv:
        cap = NOFILE - 256  # the default: the descriptor limit less the engine's reserve
        places = cap + PROBE_RESERVE  # loopback is a probe address: its reserve is held (and timed out) too
        before = _lines(log)
        socks = _connect_all(srv.port, FLOOD)
        assert len(socks) == FLOOD, "the listener stopped accepting"
        # each connection ends one of two ways: beyond the cap, a 503 JSON at once; within it, closed
        # silently (end-of-file) after the idle timeout. Read every one until it has ended.
        answers: dict[socket.socket, bytes] = {}
        t0 = time.monotonic()
        refused_after = None
        while len(answers) < len(socks):
            assert time.monotonic() - t0 < idle + 20, f"{len(socks) - len(answers)} connections neither refused nor closed"
            ready, _, _ = select.select([s for s in socks if s not in answers], [], [], 0.5)
            for s in ready:
                answers[s] = s.recv(65536)
            if refused_after is None and sum(1 for a in answers.values() if a) >= FLOOD - places:  # the 503s
                refused_after = time.monotonic() - t0
        refused = [a for a in answers.values() if a]
        held = [s for s, a in answers.items() if not a]
        # (a probe's connection still closing may take one place of the cap)
        assert len(refused) >= FLOOD - places and places - 2 <= len(held) <= places, (len(refused), len(held))
        head, _, body = refused[-1].partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after" in head.lower()
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        assert refused_after is not None and refused_after < idle, "the refusals were not immediate"
        closed_after = time.monotonic() - t0
        recovered = wait_until(lambda: _serves(srv), 10, "the server serves again")
        for s in socks:
            s.close()
        wait_until(lambda: "back under the cap" in log.read_text(), 10, "the episode's end is logged")
        flood_lines = _lines(log) - before
        text = log.read_text()
    assert "cap of 256 open connections is reached" in text and "back under the cap" in text
    assert flood_lines <= MAX_LOG_LINES, f"{flood_lines} log lines for one flood"
    record("connection_flood", case="cap", nofile=NOFILE, connections=FLOOD, max_connections=cap,
           refused_503=len(refused), idle_closed=len(held), idle_timeout_s=idle,
           seconds_to_idle_close=round(closed_after, 2), seconds_to_serve_again=round(recovered, 2),
           log_lines=flood_lines)


def test_out_of_descriptors_logs_once_and_recovers_when_connections_close(tmp_path_factory, tmp_path):
    log = tmp_path / "serve.log"
    # a cap above what the descriptor limit allows: accepts fail for lack of descriptors
    with _server(tmp_path_factory, log, "--max-connections", "2000", "--idle-timeout", "600") as srv:
        before = _lines(log)
        socks = _connect_all(srv.port, FLOOD + 200)
        wait_until(lambda: "descriptor limit (RLIMIT_NOFILE" in log.read_text(), 20, "the limit is logged")
        assert not _serves(srv), "the server still accepted: the descriptor limit was not reached"
        # hold the flood for a while: the log must stay small the whole time (not grow per accept)
        t_full = time.monotonic()
        while time.monotonic() - t_full < 3.0:
            assert _lines(log) - before <= MAX_LOG_LINES, f"{_lines(log) - before} log lines while out of descriptors"
            select.select([], [], [], 0.2)
        flood_lines = _lines(log) - before
        for s in socks:
            s.close()
        recovered = wait_until(lambda: _serves(srv), 20, "the server serves again")
        wait_until(lambda: "accepting again" in log.read_text(), 10, "the episode's end is logged")
        r = requests.post(srv.url + "/v1/images/generations", json={"prompt": "after", "size": "32x32",
                                                                     "num_inference_steps": 1}, timeout=60)
        assert r.status_code == 200, r.text[:300]
        text = log.read_text()
    assert text.count("descriptor limit (RLIMIT_NOFILE") == 1 and text.count("accepting again") == 1
    assert "Too many open files" not in text
    assert flood_lines <= MAX_LOG_LINES, f"{flood_lines} log lines while out of descriptors"
    record("connection_flood", case="out_of_descriptors", nofile=NOFILE, connections=len(socks),
           log_lines=flood_lines, seconds_to_serve_again=round(recovered, 2))
