"""What a rank's start runs beside its imports (`dlo.engine.serving.prewarm`): a cold checkpoint
read ahead into the page cache, and the device libraries' first calls."""

from __future__ import annotations

import os

from dlo.agent.residency import folder_residency, model_files
from dlo.engine.serving.prewarm import start_library_warmup, start_readahead, warm_libraries
from tests.agent.test_warm import drop  # fsync, then POSIX_FADV_DONTNEED
from tests.engine.serving_helpers import tiny_pipeline


def test_a_cold_checkpoint_is_read_ahead_and_a_warm_one_costs_nothing(tmp_path_factory):
    model = tiny_pipeline(tmp_path_factory, "wan")
    for f in model_files(model):
        drop(f)
    cold = folder_residency(model).ratio
    job = start_readahead(model, ("transformer", "text_encoder"))
    assert job is not None
    done = job.join()
    assert done is not None and done["files"] == len(model_files(model)), done
    assert done["pid"] != os.getpid()  # read by a child: its threads never take the GIL of the rank's imports
    assert folder_residency(model).ratio == 1.0 > cold
    assert start_readahead(model, ("transformer",)) is None  # every file cached: no thread, no read


def test_the_library_warmup_runs_its_calls_and_only_starts_on_cuda():
    assert warm_libraries("cpu") > 0
    assert start_library_warmup(__import__("torch").device("cpu")) is None


def test_a_readahead_that_cannot_read_says_why_and_an_orphan_reads_nothing(tmp_path):
    import subprocess
    import sys

    import pytest

    from dlo.engine.serving.readahead import ReadaheadError, read_in_child

    with pytest.raises(ReadaheadError, match="the readahead process failed: .*no such file"):
        read_in_child([tmp_path / "gone.safetensors"])
    # a child whose parent is not the one named (it went before the death signal was armed) exits
    # at once, torch never imported
    code = ("import sys; from dlo.engine.serving.readahead import main; "
            "rc = main(['--parent-pid', '1', '/nonexistent.safetensors']); print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["1", "False"], out.stderr[-2000:]
