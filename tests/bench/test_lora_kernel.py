"""`python -m bench lora-kernel --sweep`: the CPU dry run (tiny shapes, the two torch steps as the
stand-in kernel) records every kernel shape's bytes against the two steps'."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_kernel_sweep_records_every_shape_s_bytes(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    r = subprocess.run([sys.executable, "-m", "bench", "lora-kernel", "--dry-run", "--out", str(out), "--sweep",
                        "--reps", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads(out.read_text())
    shapes = rec["sweep"]["shapes"]
    assert "64x128_w4_ptiles" in shapes and len(shapes) == 8
    assert all(s["differs_from_two_steps"] == {"None": [], "0.8": []} for s in shapes.values())
    assert rec["suite"] == "lora-kernel" and rec["provenance"]["card"]["name"].startswith("cpu: ")
