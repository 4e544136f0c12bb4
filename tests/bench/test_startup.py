"""bench/startup.py (issue 34): the CPU dry run of every step of a start-up measurement (make,
the folder's disk read, evicting before a cold start, `/ready` with its phases, the output check,
SIGTERM) and `merge`'s summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import startup, startup_record

ROOT = Path(__file__).resolve().parents[2]
BENCH = [sys.executable, "-m", "bench", "startup"]


def bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_rank_zeros_log_gives_the_cold_starts_reads() -> None:
    log = ("rank0 INFO dlo.serving.prewarm readahead of 12 files not in the page cache (40 bytes) adopted "
           "(started with dlo serve's checks, 3.5 s before this load)\n"
           "rank0 INFO dlo.engine.weights early registration of transformer: 6 of 6 files, 28635462504 bytes, 21.40 s "
           "(4.10 s of it waiting for the start's other files)\n"
           "rank0 INFO dlo.engine.weights early registration of text_encoder: 3 of 3 files, 9 bytes, 20.10 s "
           "(1.20 s of it waiting for the start's other files, 18.30 s for the readahead to read the weights)\n"
           "rank0 INFO dlo.engine.weights early registration of text_encoder_2: 1 of 1 files, 5 bytes, 2.00 s "
           "(1.50 s of it waiting for the readahead to read the weights)\n"  # today's: one wait
           "rank0 INFO dlo.serving.prewarm readahead done seconds=30.10 result={'files': 12, 'bytes': 40, "
           "'seconds': 25.0, 'pid': 7, 'first': {'files': 21803, 'bytes': 5000, 'seconds': 3.9}} (beside the imports)\n"
           "rank1 INFO dlo.engine.weights early registration of transformer: 6 of 6 files, 1 bytes, 9.00 s "
           "(9.00 s of it waiting for the start's other files)\n")  # another rank's: not rank 0's figures
    assert startup_record.log_facts(log) == {
        "registration": {"transformer": {"seconds": 21.4, "waited_seconds": 4.1},
                         "text_encoder": {"seconds": 20.1, "waited_seconds": 1.2, "read_wait_seconds": 18.3},
                         "text_encoder_2": {"seconds": 2.0, "read_wait_seconds": 1.5}},
        "readahead": {"files": 12, "bytes": 40, "seconds": 25.0, "pid": 7, "job_seconds": 30.1,
                      "first": {"files": 21803, "bytes": 5000, "seconds": 3.9}},
        "readahead_lead_seconds": 3.5}
    assert startup_record.log_facts("rank0 INFO nothing here") == {}


def test_the_plan_is_read_in_order_and_a_bad_item_is_named() -> None:
    assert startup.parse_plan("resident:5,rank-local,disk-read,resident@cold:2") == [
        ("warm", "resident", 5), ("warm", "rank-local", 1), ("disk-read", "", 1), ("cold", "resident", 2)]
    assert startup.parse_plan("resident@profile,rank-local@cold-node:2") == [("profile", "resident", 1),
                                                                                  ("cold-node", "rank-local", 2)]
    with pytest.raises(ValueError, match="'resident@hot'"):
        startup.parse_plan("resident@hot")
    r = bench("run", "--raw", "/dev/null", "--plan", "fast:2")
    assert r.returncode == 2 and "--plan: 'fast:2'" in r.stderr


def test_a_profiled_start_is_summarized_by_frame_and_left_out_of_the_figures(tmp_path: Path) -> None:
    from bench.spy_profile import summarize

    raw = tmp_path / "spy.txt"
    raw.write_text("thread (1): MainThread;<module> (a.py:1);load (dlo/engine/load.py:10);f (torch/x.py:3) 30\n"
                   "thread (1): MainThread;<module> (a.py:1);_find_and_load (<frozen importlib._bootstrap>:1) 20\n"
                   "thread (2): dlo-readahead;run (dlo/serving/prewarm.py:40) 50\n")
    got = summarize(raw, rate=100)
    assert got["threads_seconds"] == {"MainThread": 0.5, "dlo-readahead": 0.5}
    assert got["module_imports"] == [["a.py", 0.5]] and got["self"][0] == ["run (dlo/serving/prewarm.py)", 0.5]
    assert ["load (dlo/engine/load.py)", 0.3] in got["dlo_inclusive"]
    assert not any("<frozen" in name for name, _ in got["inclusive"])
    starts = [{"mode": "resident", "cold": False, "ready_seconds": 11.0},
              {"mode": "resident", "cold": False, "profiled": True, "ready_seconds": 14.0}]
    assert startup_record._ready(starts, "resident", "warm") == [11.0]


def test_cold_starts_are_counted_apart_from_those_after_a_whole_page_cache_drop() -> None:
    """`cold_extra_over_disk_read` (issue 34's goal: the checkpoint evicted) and its `node_` twin
    (Python libraries cold too) come from their own starts."""
    def start(ready: float, evicted: dict | None) -> dict:
        return {"mode": "resident", "cold": evicted is not None, "evicted": evicted, "ready_seconds": ready}

    starts = [start(9.0, None), start(9.0, None), start(25.0, {"drop_caches": False}),
              start(33.0, {"drop_caches": True})]
    s = startup_record.summarize([{"starts": starts, "disk_read": {"seconds": 20.0}}])
    assert (s["ready_seconds_median"], s["cold_ready_seconds_median"], s["node_cold_ready_seconds_median"]) == (
        {"resident": 9.0}, {"resident": 25.0}, {"resident": 33.0})
    assert s["cold_extra_over_disk_read"] == {"resident": 0.8} and s["node_cold_extra_over_disk_read"] == {"resident": 1.2}


@pytest.mark.slow
def test_the_dry_run_records_warm_and_cold_starts_with_their_phases_and_merge_summarizes_them(tmp_path: Path) -> None:
    raw = tmp_path / "raw-ready.json"
    r = bench("run", "--dry-run", "--models", str(tmp_path / "models"), "--raw", str(raw),
              "--plan", "resident:1,disk-read,resident@cold:1", "--check-output")
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(raw.read_text())
    assert rec["command"].startswith("python") and "optional_packages" in rec and rec["checkpoint_bytes"] > 0
    assert rec["disk_read"]["bytes"] == rec["checkpoint_bytes"] and rec["disk_read"]["seconds"] > 0
    assert rec["disk_read"]["evicted_before"]["resident_ratio"] < 1.0 and rec["skipped_for_time"] == []
    warm, cold = rec["starts"]
    assert (warm["cold"], cold["cold"]) == (False, True)
    assert cold["evicted"]["resident_ratio"] < 1.0 and warm["evicted"] is None
    for st in (cold, warm):
        assert st["exit_code"] == 0 and st["ready_seconds"] > 0 and st["mode"] == st["server_mode"] == "resident", st
        phases = st["startup_seconds"]["phases"]
        assert {"imports", "engine_models", "settle", "warmup_decode", "warmup_denoise_beside"} <= set(phases), phases
    assert len(warm["output_sha256"]) == 64 and "output_sha256" not in cold
    # a cold start's reads, from rank 0's log: the readahead's first phase, started with dlo serve's checks
    assert cold["readahead"]["first"]["files"] > 0 and cold["readahead_lead_seconds"] > 0, cold
    assert "readahead" not in warm  # a warm folder reads nothing ahead
    assert warm["check_same_bytes"] is True and len(warm["check_seconds"]) == 2
    r = bench("merge", str(raw), "--out", str(tmp_path / "out"), "--stem", "ready-dry")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "ready-dry.json").read_text())["summary"]
    assert summary["ready_seconds_median"] == {"resident": round(warm["ready_seconds"], 2)}
    assert summary["ready_seconds_max"] == {"resident": round(warm["ready_seconds"], 2)}
    assert summary["cold_ready_seconds_median"] == {"resident": round(cold["ready_seconds"], 2)}
    assert summary["disk_read_seconds"] == rec["disk_read"]["seconds"]
    extra = (summary["cold_ready_seconds_median"]["resident"] - summary["ready_seconds_median"]["resident"])
    assert summary["cold_extra_over_disk_read"]["resident"] == round(extra / summary["disk_read_seconds"], 3)
    assert summary["failed_starts"] == summary["failed_checks"] == 0 and summary["same_output_every_mode"] is True
    md = (tmp_path / "out" / "ready-dry.md").read_text()
    assert "| resident |" in md and "s before the load; first files" in md
