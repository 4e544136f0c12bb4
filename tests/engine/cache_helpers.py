"""Shared by the step-cache tests (not a test module): a tiny Wan pipeline, the requests the tests
send, and plain diffusers' outputs for each with the same cache configuration, made once per session
in a reference process (`tests/engine/cache_reference.py`).

Each case is a request (a preset of `dlo.engine.cache_presets`, or none) and, beside it, the same
cache written as diffusers' own config class and arguments: the reference never reads our presets.
Six steps of a 3-block Wan with CFG (12 transformer calls, 36 block calls): each preset skips some
block calls (the reference counts them), none skips all.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dlo.engine.cache_presets import cache_spec
from dlo.engine.request import Generation
from tests.engine.lora_reference import REFERENCE_DIR
from tests.engine.serving_helpers import offline_env, tiny_pipeline

ROOT = Path(__file__).resolve().parents[2]
SEQ = 32  # the small limits' max_sequence_length (`dlo serve --small-limits`)
SIZE = 32
STEPS = 6
PROMPT = "a lighthouse"
RATIOS = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]

# name -> (the request's cache, diffusers' config class and arguments for the same cache)
CACHES: dict[str, tuple[Any, Any]] = {
    "none": (None, None),
    "first-block": ({"preset": "first-block", "threshold": 0.2},
                    {"class": "FirstBlockCacheConfig", "kwargs": {"threshold": 0.2}}),
    "taylorseer": ({"preset": "taylorseer", "cache_interval": 2, "disable_cache_before_step": 2,
                    "factors_dtype": "float32"},
                   {"class": "TaylorSeerCacheConfig", "kwargs": {
                       "cache_interval": 2, "disable_cache_before_step": 2, "taylor_factors_dtype": "float32",
                       "use_lite_mode": True}}),
    "mag": ({"preset": "mag", "threshold": 0.5, "mag_ratios": RATIOS},
            {"class": "MagCacheConfig", "kwargs": {"threshold": 0.5, "mag_ratios": RATIOS,
                                                   "num_inference_steps": STEPS}}),
}
# (cache, seed) of every case
CASES = [("none", 1), ("first-block", 1), ("taylorseer", 1), ("mag", 1), ("none", 2), ("first-block", 2),
         ("taylorseer", 2), ("mag", 2)]


@dataclass
class CacheSetup:
    model: Path
    reference: Path
    cases: list[tuple[str, int]] = field(default_factory=lambda: list(CASES))
    caches: dict[str, tuple[Any, Any]] = field(default_factory=lambda: dict(CACHES))

    def request(self, cache: str) -> Any:
        """The `cache` field of a request for case cache `cache` (the preset as JSON)."""
        return self.caches[cache][0]

    def gen(self, cache: str, seed: int) -> Generation:
        return Generation(kind="image", prompt=PROMPT, seed=seed, width=SIZE, height=SIZE, steps=STEPS,
                          guidance_scale=5.0, cache=cache_spec(self.caches[cache][0]))

    def case(self, cache: str, seed: int) -> int:
        return self.cases.index((cache, seed))

    def ref_array(self, cache: str, seed: int):
        import numpy as np

        return np.load(self.reference / f"case-{self.case(cache, seed)}.npy")

    def ref_bytes(self, cache: str, seed: int) -> bytes:
        return (self.reference / f"case-{self.case(cache, seed)}.out").read_bytes()

    def ref_counts(self, cache: str, seed: int) -> dict[str, int]:
        """{"block_runs", "block_calls"} of plain diffusers for the case."""
        return json.loads((self.reference / f"case-{self.case(cache, seed)}.json").read_text())


def make_cache_setup(model: Path, reference: Path, dtype: str = "float32",
                     caches: dict[str, tuple[Any, Any]] | None = None) -> CacheSetup:
    """`model`'s setup: plain diffusers' output of every case, written to `reference` by the
    reference process (`dtype`: what the folder's weights are and diffusers loads them as; `caches`:
    the cases' caches where a family needs other parameters than `CACHES`)."""
    setup = CacheSetup(model, reference, caches=dict(caches or CACHES))
    setup.reference.mkdir(parents=True, exist_ok=True)
    cases = []
    for cache, seed in setup.cases:
        gen = {k: v for k, v in setup.gen(cache, seed).__dict__.items() if k not in ("cache", "image")}
        cases.append({"config": setup.caches[cache][1], "gen": gen})
    spec = {"model_dir": str(model), "dtype": dtype, "max_sequence_length": SEQ, "cases": cases}
    (setup.reference / "spec.json").write_text(json.dumps(spec))
    env = {**offline_env(), "PYTHONPATH": str(REFERENCE_DIR)}
    r = subprocess.run([sys.executable, "-m", "tests.engine.cache_reference", str(setup.reference / "spec.json"),
                        str(setup.reference)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"the diffusers reference failed:\n{r.stdout[-2000:]}{r.stderr[-4000:]}"
    return setup


@pytest.fixture(scope="session")
def cache_setup(tmp_path_factory: pytest.TempPathFactory) -> CacheSetup:
    """The tiny Wan pipeline (float32) and plain diffusers' output of every case."""
    model = tiny_pipeline(tmp_path_factory, "wan", "float32")
    return make_cache_setup(model, tmp_path_factory.getbasetemp() / "cache-reference")


def first_block(threshold: float) -> tuple[Any, Any]:
    """The first-block case at `threshold`: the request's preset and diffusers' config."""
    return ({"preset": "first-block", "threshold": threshold},
            {"class": "FirstBlockCacheConfig", "kwargs": {"threshold": threshold}})
