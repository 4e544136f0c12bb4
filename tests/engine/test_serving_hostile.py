"""Hostile input against a live `dlo serve`: oversized bodies are refused with 413 before they are
parsed (declared or streamed), configurable limits bound every field, and with `--max-queue Q`
request Q+1 gets 429 at once while the first Q still complete."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import pytest
import requests

from dlo.serving.launch import ServerProcess
from dlo.plan.limits import SMALL
from tests.engine.serving_helpers import tiny_pipeline

pytestmark = pytest.mark.slow

MAX_QUEUE = 3
LONG_STEPS = 800  # a request that holds the single rank for a few seconds
ENDPOINT = "/v1/images/generations"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_pipeline(tmp_path_factory, "wan")
    tmp = tmp_path_factory.mktemp("hostile")
    limits = tmp / "limits.json"
    limits.write_text(json.dumps({**SMALL.model_dump(), "max_steps": LONG_STEPS, "max_n": 1, "max_frames": 5}))
    srv = ServerProcess(model, "--dp", "1", "--mode", "rank-local", "--device", "cpu", "--limits", str(limits),
                        "--max-queue", str(MAX_QUEUE), log_path=tmp / "serve.log")
    with srv:
        yield srv


def _raw_response(sock: socket.socket, timeout: float) -> tuple[int, dict]:
    """Status and JSON body of the HTTP response arriving on sock."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_a_declared_oversized_body_gets_413_before_a_byte_of_it_is_sent(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(f"POST {ENDPOINT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {10**9}\r\n\r\n".encode())
        t0 = time.monotonic()
        status, body = _raw_response(sock, timeout=10)
    assert status == 413, body
    assert body["error"]["code"] == "body_too_large" and str(SMALL.max_body_bytes) in body["error"]["message"]
    assert time.monotonic() - t0 < 5


def test_a_streamed_body_without_length_is_cut_off_at_the_limit(server):
    chunk = b"x" * 8192
    sent = 0
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(f"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Transfer-Encoding: chunked\r\n\r\n".encode())
        # keep streaming until the server answers; it must answer long before 100 limits' worth
        while sent < 100 * SMALL.max_body_bytes:
            if select.select([sock], [], [], 0)[0]:
                break
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(chunk)
        status, body = _raw_response(sock, timeout=10)
    assert status == 413 and body["error"]["type"] == "invalid_request_error", body
    assert sent < 100 * SMALL.max_body_bytes


def test_bodies_within_the_limit_are_served_and_413s_are_counted(server):
    filler = "y" * (SMALL.max_body_bytes // 2)  # within the body limit, beyond the field limit
    r = requests.post(server.url + ENDPOINT, json={"prompt": "x", "user": filler}, timeout=60)
    assert r.status_code == 200, r.text[:300]
    too_big = requests.post(server.url + ENDPOINT, json={"prompt": "x", "user": filler * 3}, timeout=60)
    assert too_big.status_code == 413
    counted = [v for labels, v in server.metrics()["dlo_requests_total"]
               if labels == {"endpoint": ENDPOINT, "method": "POST", "code": "413", "tenant": ""}]  # no keys
    assert counted and counted[0] >= 1


@pytest.mark.parametrize("path,body,param", [
    (ENDPOINT, {"prompt": "x", "n": 2}, "n"),  # max_n 1 from the limits file (the profile says 2)
    (ENDPOINT, {"prompt": "x", "negative_prompt": "z" * (SMALL.max_prompt_chars + 1)}, "negative_prompt"),
    (ENDPOINT, {"prompt": "x", "size": "144x16"}, "size"),
    (ENDPOINT, {"prompt": "x", "num_inference_steps": LONG_STEPS + 1}, "num_inference_steps"),
    ("/v1/videos", {"prompt": "x", "num_frames": 9}, "num_frames"),  # max_frames 5 from the file
    ("/v1/videos", {"prompt": "x", "seconds": "5"}, "seconds"),  # 5 s at 2 fps: 9 frames > 5
])
def test_every_generation_field_is_bounded_by_the_configured_limits(server, path, body, param):
    r = requests.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == param


def _queue_depth(server) -> float:
    return server.metrics()["dlo_queue_depth"][0][1]


def test_request_q_plus_1_gets_429_immediately_and_the_first_q_complete(server):
    results: dict[str, int] = {}

    def post(name: str, body: dict) -> None:
        results[name] = requests.post(server.url + ENDPOINT, json=body, timeout=120).status_code

    long = threading.Thread(target=post, args=("long", {"prompt": "hold the rank", "size": "128x128",
                                                        "num_inference_steps": LONG_STEPS}))
    long.start()
    # dp 1: the long request is a full wave and leaves the queue for the rank at once; then Q
    # requests fill the queue behind it
    deadline = time.monotonic() + 30
    while json.loads(server.get("/health")[1])["running"] != 1:
        assert time.monotonic() < deadline and "long" not in results, "the long request never started its wave"
        time.sleep(0.02)
    deadline = time.monotonic() + 10
    waiting = [threading.Thread(target=post, args=(f"q{i}", {"prompt": f"q{i}", "num_inference_steps": 1}))
               for i in range(MAX_QUEUE)]
    for t in waiting:
        t.start()
    while _queue_depth(server) < MAX_QUEUE:
        assert time.monotonic() < deadline and "long" not in results, "the queue never filled behind the long request"
        time.sleep(0.02)
    t0 = time.monotonic()
    extra = requests.post(server.url + ENDPOINT, json={"prompt": "one too many", "num_inference_steps": 1}, timeout=30)
    took = time.monotonic() - t0
    assert "long" not in results, "the long request ended before the check: the queue was not full"
    assert extra.status_code == 429, extra.text[:300]
    err = extra.json()["error"]
    assert err["type"] == "rate_limit_error" and f"--max-queue {MAX_QUEUE}" in err["message"]
    assert took < 1.0, f"429 took {took:.2f} s"
    for t in [long, *waiting]:
        t.join(120)
    assert results == {"long": 200, **{f"q{i}": 200 for i in range(MAX_QUEUE)}}, results
