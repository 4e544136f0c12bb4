"""`python -m bench pipeline --small-gpu`: the CPU dry run of the FP8 pair of Flux's call (a `dlo quantize`
folder, two servers through the openai SDK, the largest request and one past the limits, the drift)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_small_gpu_dry_run_streams_fp8_from_a_quantized_folder_and_records_its_figures(tmp_path: Path) -> None:
    runs = "serve_capped_24gib_zero_resident,serve_capped_24gib_zero_resident_fp8"
    r = subprocess.run([sys.executable, "-m", "bench", "pipeline", "--tiny", "--small-gpu", "--only",
                        "flux", "--runs", runs, "--requests", "1", "--models", str(tmp_path / "m"), "--out",
                        str(tmp_path / "o"), "--stem", "dry"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "o" / "dry.json").read_text())
    flux = rec["models"]["flux"]
    assert flux["quantize"]["quantized_weights"]["transformer"] > 0
    for name in runs.split(","):
        run = flux[name]
        assert "error" not in run and run["largest_request"]["ok"], run
        assert run["beyond_limits"]["status"] == 400 and run["beyond_limits"]["names_limit"], run["beyond_limits"]
        assert any("serving " in line for line in run["plan_log"])
        assert run["gather_wait_seconds_per_request"] > 0, run  # every block streamed: the compute waited
    assert "--stream-dtype" in flux["serve_capped_24gib_zero_resident_fp8"]["flags"]
    assert flux["serve_capped_24gib_zero_resident_fp8"]["output_sha256"] != flux["serve_capped_24gib_zero_resident"][
        "output_sha256"]
    s = rec["summary"]
    assert s["fp8_over_bf16_streamed_image_capped24"] is not None and s["fp8_drift"]["flux"]["psnr_db"] > 0
    assert not (tmp_path / "m").exists() or not any((tmp_path / "m").iterdir())  # both folders deleted after
