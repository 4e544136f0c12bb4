"""A client that closes its connection withdraws its request (serving/server.py,
service.withdraw): while it waits in the queue it is dropped and never reaches the ranks; while
its wave runs, the wave finishes (the collective schedule is never broken) and the result is
dropped. Both are counted as dlo_requests_total{code="499"}; the server serves on."""

from __future__ import annotations

import json
import socket

import pytest
import requests

from dlo.serving.launch import ServerProcess
from tests.engine.serving_helpers import tiny_pipeline, wait_until

pytestmark = pytest.mark.slow
ENDPOINT = "/v1/images/generations"


# The running wave must outlast the queued requests' arrival on a loaded machine: 100 steps at
# 128x128 take ~6 s on 2 cores at dp 2 (4 steps took ~0.3 s: a wave that ended first broke the test).
RUNNING_STEPS = 100
LIMITS = {"max_steps": RUNNING_STEPS, "default_steps": 2, "max_width": 128, "max_height": 128, "max_sequence_length": 32}


def _send(port: int, prompt: str, steps: int = 4) -> socket.socket:
    body = json.dumps({"prompt": prompt, "size": "128x128", "num_inference_steps": steps}).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"POST {ENDPOINT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def _health(srv: ServerProcess) -> dict:
    return requests.get(srv.url + "/health", timeout=5).json()


@pytest.mark.parametrize("mode,dp", [("resident", 1), ("allgather", 2)])
def test_clients_that_leave_are_499_and_queued_ones_never_reach_the_ranks(tmp_path_factory, tmp_path, mode, dp):
    model = tiny_pipeline(tmp_path_factory, "wan")
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps(LIMITS))
    # a full wave starts at once; the window keeps the first of dp arrivals from starting alone (a lone
    # request at dp 2, the last one, waits it out)
    with ServerProcess(model, "--dp", str(dp), "--mode", mode, "--device", "cpu", "--limits", str(limits),
                       "--no-warmup", "--wave-window-ms", "2000", log_path=tmp_path / "serve.log") as srv:
        running = [_send(srv.port, f"running {i}", RUNNING_STEPS) for i in range(dp)]
        wait_until(lambda: _health(srv)["running"] == dp, 60, "the first wave runs")
        queued = [_send(srv.port, f"queued {i}") for i in range(4)]
        wait_until(lambda: _health(srv)["queued"] == 4, 60, "the others wait in the queue")
        for s in queued + running:  # every client leaves, the running ones mid-wave
            s.close()
        wait_until(lambda: _health(srv)["queued"] == 0, 60, "the queued requests are withdrawn")
        wait_until(lambda: _health(srv)["running"] == 0, 120, "the running wave finishes")
        wait_until(lambda: {lab["code"]: v for lab, v in srv.metrics()["dlo_requests_total"]
                            if lab["endpoint"] == ENDPOINT}.get("499") == dp + 4, 30, "all six are counted 499")
        m = srv.metrics()
        codes = {lab["code"]: v for lab, v in m["dlo_requests_total"] if lab["endpoint"] == ENDPOINT}
        assert codes == {"499": dp + 4}, codes
        assert m["dlo_wave_size_sum"][0][1] == dp, "only the wave that was running reached the ranks"
        assert m["dlo_requests_running"][0][1] == 0 and m["dlo_queue_depth"][0][1] == 0
        r = requests.post(srv.url + ENDPOINT, json={"prompt": "after", "size": "64x64"}, timeout=120)
        assert r.status_code == 200 and _health(srv)["status"] == "ok"
