"""A scaled-down run of `python -m bench load` (bench/load_tiny.py) (60 requests, concurrency 8, --max-queue 4) against a
real `dlo serve` with 2 ranks: every request answered 200, 429 or 503, none lost, no 5xx other
than 503, the server's counters agree with the clients, no rank's memory grows past the bound.

The memory bound here is a gross-leak check: 60 requests in about a second cannot tell a small leak
from allocator pools growing once at this concurrency (seen: +56 MiB RSS on one rank in one CI run,
flat afterwards). The 32 MiB no-leak bound belongs to the 1,000-request benchmark, whose trace
shows the warm-up level off; 128 MiB still fails a leak of 2 MiB per request."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.engine.serving_helpers import tiny_pipeline
from tests.reliability.figures import record

pytestmark = pytest.mark.slow

REQUESTS = 60
CI_RSS_BOUND_MIB = 128


def test_scaled_down_load_loses_nothing(tmp_path_factory, tmp_path):
    model = tiny_pipeline(tmp_path_factory, "wan")
    cmd = [sys.executable, "-m", "bench", "load", "--requests", str(REQUESTS), "--concurrency", "8",
           "--max-queue", "4", "--rss-bound-mib", str(CI_RSS_BOUND_MIB), "--model", str(model), "--out", str(tmp_path),
           "--name", "load"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "load.json").read_text())
    counts = {int(k) if k != "None" else None: v for k, v in res["status_counts"].items()}
    assert sum(counts.values()) == REQUESTS
    assert res["lost"] == 0 and None not in counts, res["lost_examples"]
    assert res["non_503_5xx"] == 0 and set(counts) <= {200, 429, 503}, counts
    assert counts.get(200, 0) > 0 and counts.get(429, 0) > 0, f"expected served and backpressured requests: {counts}"
    assert all(res["checks"].values()), res["checks"]
    record("load_ci", requests=REQUESTS, status_counts=res["status_counts"], lost=res["lost"],
           p50_ms=round(1000 * res["latency_200_seconds"]["p50"]), p99_ms=round(1000 * res["latency_200_seconds"]["p99"]))
