"""`dlo serve`'s connection rules over raw sockets (serving/http_protocol.py, connections.py):
request heads of at most 16 KiB (431 in OpenAI's JSON beyond, whole or trickled), Content-Length
with Transfer-Encoding closes the connection after its answer (RFC 9112 6.3), HEAD /health, a body
that stops or trickles gets 408 within the body timeout, and the connection cap keeps a reserve for
/health, /ready and /metrics from probe addresses (loopback, --probe-cidr) that nobody else gets."""

from __future__ import annotations

import json
import socket
import time

import psutil
import pytest

from dlo.serving.launch import ServerProcess
from tests.engine.serving_helpers import tiny_pipeline, wait_until

pytestmark = pytest.mark.slow

HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
SLOW_HEAD = (b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: 4000\r\n\r\n{\"prompt\": ")


def _exchange(host: str, port: int, data: bytes, source: str | None = None, timeout: float = 10) -> bytes:
    s = socket.socket()
    s.settimeout(timeout)
    if source:
        s.bind((source, 0))
    s.connect((host, port))
    try:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out
    finally:
        s.close()


def _status_and_error(resp: bytes) -> tuple[int, str | None]:
    head, _, body = resp.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]["code"]


def _serve(tmp_path_factory, tmp_path, *args: str) -> ServerProcess:
    model = tiny_pipeline(tmp_path_factory, "wan")
    return ServerProcess(model, "--dp", "1", "--mode", "resident", "--device", "cpu", "--small-limits", "--no-warmup",
                         *args, log_path=tmp_path / "serve.log")


def _non_loopback_address() -> str:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    raise AssertionError("this host has no non-loopback IPv4 address to test a non-probe client from")


def test_heads_framing_and_head_requests(tmp_path_factory, tmp_path):
    with _serve(tmp_path_factory, tmp_path) as srv:
        pad = lambda n: b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * n + b"\r\nConnection: close\r\n\r\n"  # noqa: E731
        assert _exchange("127.0.0.1", srv.port, pad(8 * 1024)).startswith(b"HTTP/1.1 200")
        for n in (17 * 1024, 200 * 1024):
            assert _status_and_error(_exchange("127.0.0.1", srv.port, pad(n))) == (431, "headers_too_large")
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)  # a head trickled in pieces
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            answer = b""
            for _ in range(40):
                try:
                    s.sendall(b"X-Pad: " + b"a" * 1000 + b"\r\n")
                except OSError:
                    break
            while chunk := s.recv(65536):
                answer += chunk
        except OSError:
            pass
        finally:
            s.close()
        assert _status_and_error(answer) == (431, "headers_too_large")
        # both framings at once: the chunked body is read, answered, and the connection closes
        smuggle = (b"POST /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
                   b"0\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = _exchange("127.0.0.1", srv.port, smuggle)
        assert answer.count(b"HTTP/1.1 ") == 1 and answer.startswith(b"HTTP/1.1 405"), answer[:200]
        head = _exchange("127.0.0.1", srv.port, b"HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n")  # no body
        garbage = _exchange("127.0.0.1", srv.port, b"GARBAGE\x00 / HTTP/9\r\n\r\n")
        assert _status_and_error(garbage) == (400, "invalid_http")


def test_a_stopped_or_trickled_body_is_408_within_the_body_timeout(tmp_path_factory, tmp_path):
    with _serve(tmp_path_factory, tmp_path, "--body-timeout", "1", "--min-body-rate", "1000") as srv:
        t0 = time.monotonic()
        assert _status_and_error(_exchange("127.0.0.1", srv.port, SLOW_HEAD, timeout=30)) == (408, "request_timeout")
        stopped_s = time.monotonic() - t0
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        s.sendall(SLOW_HEAD)
        answer, t0 = b"", time.monotonic()
        while not answer and time.monotonic() - t0 < 30:  # 2 bytes a second: below the minimum rate
            try:
                s.sendall(b"aa")
            except OSError:
                break
            s.settimeout(1.0)
            try:
                answer = s.recv(65536)
            except socket.timeout:
                continue
        s.close()
        assert _status_and_error(answer) == (408, "request_timeout")
        assert stopped_s < 10 and time.monotonic() - t0 < 20
        assert _exchange("127.0.0.1", srv.port, HEALTH).startswith(b"HTTP/1.1 200")


def test_the_cap_keeps_a_reserve_for_probes_from_probe_addresses_only(tmp_path_factory, tmp_path):
    outside = _non_loopback_address()
    for probe_cidr in ((), ("--probe-cidr", f"{outside}/32")):
        with _serve(tmp_path_factory, tmp_path, "--host", "0.0.0.0", "--max-connections", "2",
                    "--body-timeout", "60", *probe_cidr) as srv:
            holders = [socket.create_connection(("127.0.0.1", srv.port), timeout=10) for _ in range(2)]
            try:
                for s in holders:
                    s.sendall(SLOW_HEAD)  # they hold the cap
                wait_until(lambda: _exchange("127.0.0.1", srv.port, b"POST /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                           .startswith(b"HTTP/1.1 503"), 20, "the cap is held")
                for path in (b"/health", b"/ready", b"/metrics"):  # loopback is a probe address
                    resp = _exchange("127.0.0.1", srv.port, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n"
                                     b"Connection: close\r\n\r\n")
                    assert resp.startswith(b"HTTP/1.1 200"), (path, resp[:100])
                other = _exchange("127.0.0.1", srv.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                assert _status_and_error(other) == (503, "too_many_connections")  # the reserve: probes only
                far = _exchange(outside, srv.port, HEALTH, source=outside)
                if probe_cidr:
                    assert far.startswith(b"HTTP/1.1 200"), far[:100]
                else:
                    assert _status_and_error(far) == (503, "too_many_connections")
            finally:
                for s in holders:
                    s.close()
