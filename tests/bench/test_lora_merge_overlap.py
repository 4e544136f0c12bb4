"""bench/lora_merge_overlap.py and bench/lora_merge_kernel.py --sweep: the CPU dry runs (tiny shapes,
the two torch steps): every way gives the in-line merges' bytes, the look-ahead takes the merges it
queued, and the sweep records every kernel shape's bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, out: Path, *argv: str) -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--dry-run", "--out", str(out), *argv],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


def test_every_way_of_placing_a_block_s_merges_gives_the_same_bytes(tmp_path: Path) -> None:
    ways = _run("lora_merge_overlap.py", tmp_path / "o.json", "--reps", "3")["wan2.1-14b"]["ways"]
    assert set(ways) == {"base", "serial_torch", "ahead_torch", "upfront_torch"}
    for name, way in ways.items():
        if name != "base":
            assert way["same_bytes_as_serial"] and way["differs_from_base"], name
    assert ways["ahead_torch"]["ahead_hits"] >= 9 * 3  # nine of a block's ten merges queued ahead, every call
    assert ways["serial_torch"]["ahead_hits"] is None


def test_the_kernel_sweep_records_every_shape_s_bytes(tmp_path: Path) -> None:
    rec = _run("lora_merge_kernel.py", tmp_path / "s.json", "--sweep", "--reps", "2")
    shapes = rec["sweep"]["shapes"]
    assert "64x128_w4_ptiles" in shapes and len(shapes) == 8
    assert all(s["differs_from_two_steps"] == {"None": [], "0.8": []} for s in shapes.values())
