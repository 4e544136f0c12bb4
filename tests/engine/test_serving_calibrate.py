"""`dlo calibrate` writes a NodeProfile fragment with measured bandwidths (2 gloo ranks on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_calibrate_writes_a_fragment_the_agent_accepts(tmp_path):
    out = tmp_path / "fragment.json"
    res = subprocess.run([sys.executable, "-m", "dlo.cli.main", "calibrate", "--device", "cpu", "--ranks", "2",
                          "--mib", "8", "--iters", "2", "--out", str(out)], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(data) == {"h2d_bandwidth_bps", "collective_bandwidth_bps"}
    assert all(isinstance(v, int) and v > 1_000_000 for v in data.values()), data
    from dlo.plan.profile import CalibrationFragment, NodeProfile, apply_calibration

    profile = apply_calibration(NodeProfile(), CalibrationFragment.model_validate(data))
    assert profile.measured and profile.h2d_bandwidth_bps == data["h2d_bandwidth_bps"]
