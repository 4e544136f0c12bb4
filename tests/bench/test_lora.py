"""bench/lora.py (`python -m bench lora`): the CPU dry run of every step (the adapters from `dlo make-random-lora`, the
per-block variants in their own process, a `dlo serve --lora-dir` run), and `merge` into the record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import lora, lora_record

ROOT = Path(__file__).resolve().parents[2]
BENCH = [sys.executable, "-m", "bench", "lora"]


@pytest.mark.slow
def test_the_dry_run_measures_every_step_and_merges_into_the_record(tmp_path: Path) -> None:
    from dlo.engine.presets import preset
    from dlo.engine.random_model import write_pipeline

    write_pipeline(tmp_path / "models" / "tiny-flux.1-dev", preset("tiny-flux.1-dev"))  # the bench's make skips it
    r = subprocess.run([*BENCH, "run", "--dry-run", "--only", "flux", "--runs", "serve_rank_local,serve_resident_merge_cached",
                        "--requests", "1", "--models", str(tmp_path / "models"), "--out", str(tmp_path / "out"),
                        "--stem", "raw-dry"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "raw-dry.json").read_text())
    flux = rec["models"]["flux"]
    assert flux["make"] == {"skipped": "present", "bytes": flux["checkpoint_bytes"]}
    assert {a: flux["adapters"][a]["rank"] for a in ("r64", "r64-attention")} == {"r64": 8, "r64-attention": 8}  # the dry run's tiny rank
    row = flux["per_block"]["workloads"]["64"]
    assert set(row) == {"base", "lora", "lora_scale_0.8", "lora_separate_add", "lora_unfolded", "lora_attention",
                        "merge", "merge_in_gemm"}
    assert row["lora_unfolded"]["bit_identical_to_lora"] and not row["base"]["bit_identical_to_lora"]
    assert isinstance(row["merge_in_gemm"]["bit_identical_to_merge"], bool)  # the device's verdict; cpu's tells nothing
    adapters = flux["per_block"]["adapters"]
    assert adapters["r64"]["device_bytes"] > adapters["r64-attention"]["device_bytes"] > 0

    run = flux["serve_rank_local"]
    # every block streamed (auto resident blocks keep what fits), the branch asked for
    assert run["flags"][-4:] == ["--resident-blocks", "0", "--lora-apply", "branch"]
    assert lora_record.apply_of(run["flags"]) == "branch"
    # no flag: auto for the `*_auto` runs; the branch for a raw from before auto was the default
    assert lora_record.apply_of(["--mode", "resident"], "serve_resident_auto") == "auto"
    assert lora_record.apply_of(["--mode", "rank-local"], "serve_rank_local") == "branch"
    assert run["exit_code"] == 0 and set(run["seconds"]) == {"base", "lora"} and run["same_bytes_every_request"]
    assert run["lora_device_bytes"] == {"0": adapters["r64"]["device_bytes"]}
    assert all(x > 0 for v in ("base", "lora") for x in run["step_seconds"][v])  # the denoising steps, per request
    s = rec["summary"]["flux"]
    assert s["lora_changes_output"] and s["fold_bit_identical"] and isinstance(s["merge_in_gemm_bit_identical"], bool)
    assert set(s["end_to_end_ratio"]) == {"serve_rank_local", "serve_resident_merge_cached"} == set(s["denoise_ratio"])
    assert flux["serve_resident_merge_cached"]["flags"][-4:] == ["--lora-apply", "merge", "--lora-merge-cache", "1GiB"]
    assert s["base_bytes_identical_across_modes"]  # the same request without an adapter, either way
    assert not (tmp_path / "models" / "tiny-flux.1-dev").exists()  # deleted after its runs (disk)
    m = subprocess.run([*BENCH, "merge", str(tmp_path / "out" / "raw-dry.json"), "--out",
                        str(tmp_path), "--stem", "lora-dry"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert m.returncode == 0, m.stderr[-2000:]
    md = (tmp_path / "lora-dry.md").read_text()
    assert "CPU dry run: no figure here is a result" in md and "| serve_rank_local |" in md
    assert json.loads((tmp_path / "lora-dry.json").read_text())["summary"]["goal"] == 1.03


def test_a_longer_video_request_is_a_workload_of_its_own() -> None:
    """`--frames`: a video model's runs at N frames go under `KEY-Nf` (never merged with the default
    request's); an image model's request keeps its shape; `--steps` applies to both."""
    import argparse


    args = argparse.Namespace(dry_run=False, frames=81, steps=3)
    key, spec = lora.request_of("wan21", args)
    assert key == "wan21-81f" and spec["request"]["frames"] == 81 and spec["request"]["steps"] == 3
    assert lora.MODELS["wan21"]["request"]["frames"] == 17  # the default request untouched
    key, spec = lora.request_of("flux", args)
    assert key == "flux" and "frames" not in spec["request"] and spec["request"]["steps"] == 3
    assert lora.request_of("wan21", argparse.Namespace(dry_run=False, frames=0, steps=0))[0] == "wan21"


def test_merge_takes_each_step_of_a_model_from_the_call_that_ran_it(tmp_path: Path) -> None:
    """Wan2.1's runs take several calls: the record keeps every measured step, and a step a later call
    skipped (the make, `--no-per-block`) never hides the one an earlier call measured."""
    def raw(name: str, **steps) -> Path:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"date": "d", "device": "x", "command": name, "models": {"flux": steps}}))
        return path

    run = {"flags": ["--mode", "resident"], "ratio": 1.01, "seconds": {"base": 1.0, "lora": 1.01},
           "output_sha256": {"base": "b", "lora": "l"}}
    first = raw("a", make={"bytes": 5}, per_block={"workloads": {}}, serve_resident=run)
    second = raw("b", make={"skipped": "present"}, per_block={"skipped": "--no-per-block"},
                 serve_rank_local={**run, "flags": ["--mode", "rank-local"], "ratio": 0.99})
    m = subprocess.run([*BENCH, "merge", str(first), str(second), "--out", str(tmp_path),
                        "--stem", "both"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert m.returncode == 0, m.stderr[-2000:]
    flux = json.loads((tmp_path / "both.json").read_text())["models"]["flux"]
    assert flux["make"] == {"bytes": 5} and flux["per_block"] == {"workloads": {}}
    assert {n: flux[n]["ratio"] for n in ("serve_resident", "serve_rank_local")} == {"serve_resident": 1.01,
                                                                                    "serve_rank_local": 0.99}


def test_a_failed_run_is_in_the_record_s_table(tmp_path: Path) -> None:
    """A serve run that failed on the device (an H100's resident run, 2026-12-06) is a row of the
    markdown too, with its error, not only a key of the raw."""

    raw = ROOT / "bench" / "results" / "raw-lora-h200-2026-12-06-wan21-steps.json"
    lora_record.merge([raw], tmp_path, "lora-failed")
    md = (tmp_path / "lora-failed.md").read_text()
    assert "| serve_resident_auto | failed: RuntimeError: video failed:" in md
    # each side's median with its spread and first request; the ratio median over median, first over
    # first (the fastest over the fastest, 12.876 / 12.143, never alone)
    assert ("| serve_rank_local_auto | 12.232 s (median of 2: 12.143-12.322; first 12.322) | 13.030 s (median of 2: "
            "12.876-13.184; first 13.184) | 1.0652x (medians, first requests 1.0700x) | False |") in md
    s = json.loads((tmp_path / "lora-failed.json").read_text())["summary"]["wan21"]
    base = s["request_seconds"]["serve_rank_local_auto"]["base"]
    assert (base["first"], base["n"], base["min"], base["max"]) == (12.322, 2, 12.143, 12.322)
    assert s["end_to_end_ratio"]["serve_rank_local_auto"]["median"] == 1.0652
