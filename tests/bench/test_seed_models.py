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


def test_the_served_side_s_tries_have_their_spread_and_the_ratio_divides_medians_and_firsts() -> None:
    """The served request tried twice: its seconds are both tries' spread (first apart), and the ratio
    to diffusers is median over median and first over first, never the faster try over diffusers."""
    from bench.seed_models_record import markdown, summarize

    video = {"kind": "video", "step_seconds": [0.3, 0.3]}
    rec = {"model": "cosmos3-nano", "family": "cosmos3", "make": {"preset": "p", "blocks": 2},
           "request": {"steps": 2, "recommended_steps": 4},
           "runs": {"diffusers_resident": {"requests": [{**video, "seconds": 5.0}]},
                    "serve_rank_local": {"requests": [{"kind": "video", "seconds": 5.2, "step_seconds_mean": 0.3,
                                                       "tries_seconds": [5.6, 5.2], "videos_per_hour": 692.3}]}}}
    s = summarize([rec])
    served = s["models"]["cosmos3-nano"]["runs"]["serve_rank_local"]
    assert served["seconds"] == {"first": 5.6, "median": 5.4, "n": 2, "min": 5.2, "max": 5.6}
    assert s["cosmos3_nano_e2e_over_diffusers"] == {"median": 1.08, "first": 1.12, "n": [2, 1]}  # not 5.2 / 5.0
    assert "fastest try" in s["throughput_from"]
    md = markdown({"date": "2026-12-01", "files": ["raw.json"], "card": "c", "models": {"cosmos3-nano": rec},
                   "summary": s})
    assert "5.400 s (median of 2: 5.200-5.600; first 5.600) | 1.0800x (medians, first requests 1.1200x)" in md
