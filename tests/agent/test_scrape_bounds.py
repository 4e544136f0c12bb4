"""The agent against hostile engines: one whose /metrics trickles and one that sends far too much
cannot hold the agent's /metrics or /profile; each is skipped at the scrape deadline or byte bound
and counted, and the well-behaved engine's series are there."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dlo.agent.pods import SCRAPE_TIMEOUT_S
from dlo.agent.server import serve

from .conftest import make_agent, pods_for, samples

TRICKLE_S = 30.0  # how long the slow engine keeps sending, a byte at a time
FLOOD_BYTES = 16 * 2**20  # what the other sends (twice the agent's bound)


class _Hostile(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        try:
            if self.path.startswith("/slow"):
                ends = time.monotonic() + TRICKLE_S
                while time.monotonic() < ends:
                    self.wfile.write(b"#")
                    self.wfile.flush()
                    time.sleep(0.2)
            else:
                line = b"# " + b"x" * 1022 + b"\n"
                for _ in range(FLOOD_BYTES // len(line)):
                    self.wfile.write(line)
        except OSError:
            pass  # the agent hung up on us

    def log_message(self, *a: object) -> None:
        pass


@pytest.fixture
def hostile_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _timed_get(url: str) -> tuple[float, int, str]:
    started = time.monotonic()
    with urllib.request.urlopen(url, timeout=120) as r:
        return time.monotonic() - started, r.status, r.read().decode()


def test_a_trickling_or_flooding_engine_is_skipped_and_counted_and_holds_nothing(models_root: Path, engine_url: str,
                                                                                   hostile_url: str) -> None:
    agent = make_agent(models_root, pods_for(engine_url), engine_urls=[f"{hostile_url}/slow", f"{hostile_url}/big"])
    server = serve(agent, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with ThreadPoolExecutor(3) as pool:  # Prometheus twice and a /profile reader, at once
            answers = list(pool.map(_timed_get, [base + "/metrics", base + "/metrics", base + "/profile"]))
        _, _, text = _timed_get(base + "/metrics")
    finally:
        server.shutdown()
    bound = SCRAPE_TIMEOUT_S + 3.0
    for seconds, status, _ in answers:
        assert status == 200 and seconds < bound, f"an answer took {seconds:.1f} s (bound {bound:g} s)"
    got = samples(text)
    pinned = {(lab["pod"], lab["source"]) for lab, _ in got["dlo_pod_host_pinned_bytes"]}
    assert pinned == {("wan-0", "arena"), ("wan-0", "registered")}
    skipped = {lab["reason"]: v for lab, v in got["dlo_agent_engine_scrapes_skipped"] if "reason" in lab}
    assert skipped == {"timeout": 3.0, "too_large": 3.0}, skipped
