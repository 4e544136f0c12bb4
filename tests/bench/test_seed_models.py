"""`python -m bench seed-models`: the CPU dry run (tiny-cosmos3 for cosmos3-nano): the plain-diffusers child and
a `dlo serve` run produce one raw record, and its merge carries the summary keys issue 28 names,
with the served bytes identical to diffusers' and the per-run video figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_dry_run_records_the_published_figures(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "bench", "seed-models", "--model", "cosmos3-nano", "--dry-run",
                          "--runs", "diffusers_resident,serve_streamed", "--models", str(tmp_path / "models"),
                          "--out", str(out)], capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    raw = sorted(out.glob("seed-models-cosmos3-nano-*-raw.json"))
    assert len(raw) == 1
    merge = subprocess.run([sys.executable, "-m", "bench", "seed-models", "--merge", str(raw[0]),
                            "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert merge.returncode == 0, merge.stderr[-3000:]
    merged = json.loads(next(out.glob("seed-models-20*[0-9].json")).read_text())
    s = merged["summary"]
    assert s["pixel_identical_to_diffusers"] == {"cosmos3-nano": True}  # the PNG and the MP4 with its sound
    runs = s["models"]["cosmos3-nano"]["runs"]
    assert set(runs) == {"diffusers_resident", "serve_streamed"}
    for r in runs.values():
        assert r["videos_per_hour"] > 0 and r["generated_frames_per_second"] > 0
        assert r["wh_per_video"] is None and r["energy_joules_per_gpu"] is None  # no NVML counter on CPU: not 0
        assert r["per_step_seconds"] > 0
    assert "cosmos3_nano_e2e_over_diffusers" in s  # None here: serve_rank_local did not run
    assert (out / merged["files"][0]).name and next(out.glob("seed-models-20*.md")).read_text().startswith("#")
