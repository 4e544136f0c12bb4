"""A normal start prints no third-party noise (serving/library_noise.py): no `torch_dtype` FutureWarning (the
adapters pass `dtype`), diffusers' `pip install accelerate` hint filtered by its text, progress bars
only on a terminal, and `dlo demo` prints no line per HTTP request."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import warnings

import pytest

from dlo.serving.library_noise import ACCELERATE_HINT, quiet_libraries
from tests.engine.serving_helpers import offline_env

NOISE = ["FutureWarning", "torch_dtype", "pip install accelerate", "Loading pipeline components", "it/s]",
         "HTTP Request:"]


def test_only_the_named_messages_are_filtered_and_bars_need_a_terminal(monkeypatch, caplog):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_libraries(io.StringIO())  # not a terminal
        warnings.warn("something else is deprecated", FutureWarning)
    assert [str(w.message) for w in seen] == ["something else is deprecated"]  # no warning is filtered
    hint = logging.getLogger("diffusers.pipelines.pipeline_utils")
    with caplog.at_level(logging.WARNING):
        hint.warning(f"Cannot initialize model with low cpu memory usage because {ACCELERATE_HINT} in the env.")
        hint.warning("Passed `dtype` 7 is not a `torch.dtype`.")
    assert [r.getMessage() for r in caplog.records] == ["Passed `dtype` 7 is not a `torch.dtype`."]
    import os

    assert os.environ["TQDM_DISABLE"] == "1"
    monkeypatch.setenv("TQDM_DISABLE", "0")  # the user's choice stays
    quiet_libraries(io.StringIO())
    assert os.environ["TQDM_DISABLE"] == "0"


@pytest.mark.slow
def test_the_demo_and_its_two_ranks_print_no_third_party_noise(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dlo.cli.main", "demo", "--out", str(tmp_path), "--steps", "1",
                        "--size", "32x32"], capture_output=True, text=True, env=offline_env(), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    log = (tmp_path / "serve.log").read_text()
    assert "rank1 INFO" in log and "all 2 ranks ready" in log
    for text, where in ((r.stdout + r.stderr, "dlo demo's output"), (log, "serve.log")):
        found = [n for n in NOISE if n in text]
        assert not found, f"{where} holds {found}"
