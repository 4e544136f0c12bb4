"""bench/hsdp.py's wiring (issue 33) on two gloo ranks: the dry run of the HSDP bench writes a raw
record of the four phases, every DLO output equals the resident reference bit for bit and HSDP's
(FSDP2 + diffusers' Ulysses) are within the bench's stated tolerance. Figures are the GPU call's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUNS = {
    "reference": {"video/one/b1": 1, "image/one/b1": 1},
    "hsdp": {"video/dp/b1": 2, "image/dp/b1": 2, "video/sp/b1": 1, "image/sp/b1": 1, "image/sp/b2": 2},
    "dlo_allgather": {"video/dp/b1": 2, "image/dp/b1": 2, "video/sp/b1": 1, "image/sp/b1": 1},
    "dlo_ranklocal": {"video/dp/b1": 2, "image/dp/b1": 2, "video/sp/b1": 1, "image/sp/b1": 1},
}  # run -> requests per call (sp 1 waves on both ranks, then sp 2)


@pytest.mark.slow
def test_dry_run_records_every_phase_and_outputs_match_the_reference(tmp_path):
    raw = tmp_path / "raw.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "hsdp", "run", "--dry-run", "--raw", str(raw),
                           "--hsdp-batches", "1,2", "--work", str(tmp_path / "work"), "--ckpt", str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rec = json.loads(raw.read_text())
    assert rec["ranks"] == 2 and rec["device"] == "cpu" and rec["layers"] == 3
    assert rec["suite"] == "hsdp" and rec["provenance"]["card"]["name"].startswith("cpu: ")
    assert set(rec["phases"]) == set(RUNS), rec["phases"]
    for phase, runs in RUNS.items():
        per_rank = rec["phases"][phase]
        assert isinstance(per_rank, list) and [r["rank"] for r in per_rank] == [0, 1], (phase, per_rank)
        for r in per_rank:
            assert {k: v["requests"] for k, v in r["runs"].items()} == runs, (phase, r["runs"].keys())
            assert all(v["seconds"] > 0 and len(v["all"]) == 2 for v in r["runs"].values())
            assert r["host_end"]["Pss"] > 0 and r["host_loaded"]["Pss"] > 0
    # every run of the three engines was compared with the reference's seed-1 output
    outs = rec["outputs"]
    assert {p: set(v) for p, v in outs.items()} == {p: set(v) for p, v in RUNS.items() if p != "reference"}
    for phase in ("dlo_allgather", "dlo_ranklocal"):
        for key, c in outs[phase].items():
            assert c["bit_identical"] and c["max_abs_diff"] == 0, (phase, key, c)
    for key, c in outs["hsdp"].items():
        if key.endswith("/b1"):
            assert c["bit_identical"], (key, c)
        else:  # the stated tolerance for a batch
            assert c["bit_identical"] or c["psnr_db"] >= 40, (key, c)
    s = rec["summary"]
    assert s["dlo_bit_identical"] is True and s["hsdp_within_tolerance"] is True
    assert not s["failed"] and not s["skipped"]
    for key in ("dlo_over_hsdp_video_sp", "dlo_seconds_per_request_over_hsdp_image_waves"):
        assert math.isfinite(s[key]) and s[key] > 0, key
    assert "dlo_device_memory_over_hsdp" in s and s["dlo_device_memory_over_hsdp"] is None  # no device on cpu
    assert s["hsdp_best_image"]["run"] in RUNS["hsdp"]
