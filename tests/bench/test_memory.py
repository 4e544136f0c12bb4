"""bench/memory.py (`python -m bench memory`): the calibration's CPU dry run (every step's wiring, every family in its own
process), and `merge` fitting the memory table from raw records (and refusing a dry run's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dlo.plan.memory_model import Geometry, PipelineMemory, RequestBounds, Shape, features
from dlo.plan.memory_table import MemoryTable

ROOT = Path(__file__).resolve().parents[2]
BENCH = [sys.executable, "-m", "bench", "memory"]
# the families whose parts differ (an image encoder and VAE encode; a second text encoder): the
# table is calibrated, so the dry run guards the bench's wiring, not each family's plan again
FAMILIES = ("wan-i2v", "flux")


def bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*BENCH, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


@pytest.mark.slow
def test_the_dry_run_measures_every_part_and_merge_refuses_it(tmp_path: Path) -> None:
    r = bench("run", "--dry-run", "--families", ",".join(FAMILIES), "--models", str(tmp_path / "models"),
              "--out", str(tmp_path / "out"), "--stem", "dry")
    assert r.returncode == 0, r.stderr[-3000:]
    for family in FAMILIES:
        rec = json.loads((tmp_path / "out" / f"dry-{family}.json").read_text())
        assert rec["exit_code"] == 0 and not rec["skipped"] and "error" not in rec, rec.get("error")
        parts = {ph["part"] for ph in rec["phases"] if "error" not in ph}
        errors = [ph for ph in rec["phases"] if "error" in ph]
        assert not errors, errors
        want = {"transformer", "vae_decode", "vae_decode_tiled", "text_encoder", "pipeline"}
        want |= {"text_encoder_2"} if family == "flux" else set()
        want |= {"image_encoder", "vae_encode", "vae_encode_tiled"} if family == "wan-i2v" else set()
        assert parts == want, family
        assert {"transformer", "vae"} <= set(rec["loads"]) and rec["loads"]["transformer"]["expected_bytes"] > 0
        assert rec["geometry"]["size_multiple"] == 16 and rec["alloc_conf_in_environment"] is None
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())  # deleted after each
    m = bench("merge", *map(str, sorted((tmp_path / "out").glob("dry-*.json"))), "--table", str(tmp_path / "t.json"),
              "--out", str(tmp_path), "--stem", "merged")
    assert m.returncode == 2 and "a CPU dry run measures no device memory" in m.stderr
    assert not (tmp_path / "t.json").exists()


def _phase(part: str, activation: float, reserve: float, shape: Shape | None = None, **extra: object) -> dict:
    base = 10**9
    ph = {"part": part, "base_allocated": base, "base_reserved": base + 10**8, "peak_allocated": base + activation,
          "peak_reserved": base + 10**8 + activation + reserve, "seconds": 0.1, **extra}
    if shape is not None:
        ph["shape"] = {"width": shape.width, "height": shape.height, "frames": shape.frames, "batch": shape.batch}
    return ph


def test_merge_fits_the_table_the_memory_model_reads(tmp_path: Path) -> None:
    """A raw record whose peaks follow known lines (as one from the GPU would, with noise-free
    numbers): the merge recovers each line and the table predicts from it."""
    geometry = Geometry(16, 4)
    phases = []
    for shape in (Shape(832, 480, 17), Shape(832, 480, 81), Shape(1280, 720, 81)):
        tokens = features("transformer", shape, geometry, 512)["tokens"]
        phases.append(_phase("transformer", 1e8 + 2e5 * tokens, 0.02 * (1e8 + 2e5 * tokens), shape))
    for part, slope in (("vae_decode", 3000), ("vae_decode_tiled", 500)):
        for shape in (Shape(832, 480, 5), Shape(832, 480, 17), Shape(1280, 720, 5), Shape(1280, 720, 17)):
            x = features(part, shape, geometry, 512)
            phases.append(_phase(part, 2e8 + slope * x["area"] + 40 * x["pixels"], 0.0, shape))
    phases += [_phase("text_encoder", 5e7 + 1e5 * seq, 0.0, sequence=seq) for seq in (128, 512)]
    phases.append(_phase("vae_decode", 0, 0, Shape(2048, 2048, 81), error="OutOfMemoryError: CUDA out of memory"))
    raw = {"family": "wan", "preset": "wan2.1-t2v-14b", "layers": 2, "device_name": "NVIDIA H200",
           "geometry": {"size_multiple": 16, "temporal_factor": 4, "image_input": False}, "phases": phases,
           "loads": {"transformer": {"expected_bytes": 2 * 10**9, "allocated": 2 * 10**9, "reserved": 2_020_000_000},
                     "vae": {"expected_bytes": 5 * 10**8, "allocated": 5 * 10**8, "reserved": 505_000_000}},
           "context_bytes": {"device_used_minus_reserved": 600_000_000, "process_minus_reserved": 550_000_000},
           "plan": {"sequences": [128, 512]}, "skipped": []}
    (tmp_path / "raw-wan.json").write_text(json.dumps(raw))
    r = bench("merge", str(tmp_path / "raw-wan.json"), "--table", str(tmp_path / "t.json"), "--out", str(tmp_path),
              "--stem", "memory-test")
    assert r.returncode == 0, r.stderr
    table = MemoryTable.load(tmp_path / "t.json")
    fam = table.families["wan"]
    assert set(fam.parts) == {"transformer", "vae_decode", "vae_decode_tiled", "text_encoder"}  # the OOM is no point
    # the table predicts each part's reserved growth (its activations and the 2% the allocator kept beside them) ...
    assert fam.parts["transformer"].coef == pytest.approx((1.02e8, 2.04e5), rel=1e-6)
    assert fam.parts["vae_decode"].coef == pytest.approx((2e8, 3000, 40), rel=1e-6)
    assert table.context_bytes == 550_000_000
    assert table.weights_overhead is not None and table.weights_overhead.coef == pytest.approx((0, 0.01), abs=1e-6)
    record = json.loads((tmp_path / "memory-test.json").read_text())
    # ... and the record fits the activations beside it, as a check
    assert record["report"]["wan"]["activation_fits"]["transformer"]["coef"] == pytest.approx([1e8, 2e5], rel=1e-6)
    assert record["report"]["wan"]["errors"][0]["error"].startswith("OutOfMemoryError")
    assert (tmp_path / "memory-test.md").read_text().count("| wan |") == 4
    from dlo.plan.facts import ModelFacts

    t = ModelFacts(bytes=28_640_000_000, largest_block_bytes=703_000_000, blocks=40, nonblock_bytes=500_000_000)
    memory = PipelineMemory("wan", geometry, {"transformer": t}, {"text_encoder": t}, {}, RequestBounds(832, 480, 17),
                            1280 * 720 * 81, table)
    assert memory.rank("rank-local").request_bytes is not None
