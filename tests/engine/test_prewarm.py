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
    job = start_readahead(model, ("transformer", "text_encoder"), packages=("safetensors",))
    assert job is not None
    done = job.join()
    assert done is not None and done["files"] == len(model_files(model)), done
    assert done["first"]["files"] > 1  # the package's code and the folder's configs, before the weights
    assert done["pid"] != os.getpid()  # read by a child: its threads never take the GIL of the rank's imports
    assert folder_residency(model).ratio == 1.0 > cold
    assert start_readahead(model, ("transformer",)) is None  # every file cached: no thread, no read


def test_the_readahead_reads_the_starts_code_and_small_files_before_the_weights(tmp_path_factory, tmp_path):
    from dlo.agent.residency import file_residency
    from dlo.engine.serving.prewarm import START_PACKAGES, package_folders
    from dlo.engine.serving.readahead import read_in_child, startup_files

    pkg = tmp_path / "pkg"
    (pkg / "__pycache__").mkdir(parents=True)
    code = [pkg / "a.py", pkg / "__pycache__" / "a.cpython-311.pyc", pkg / "libx.so.9", pkg / "_c.so"]
    other = [pkg / "x.h", pkg / "notes.txt"]
    for i, f in enumerate(code + other):
        f.write_bytes(bytes([i]) * (4096 * (i + 1)))
    model = tiny_pipeline(tmp_path_factory, "wan")
    small = [f for f in sorted(model.rglob("*")) if f.is_file() and f.suffix != ".safetensors"]
    assert small and set(startup_files((pkg,), (model,))) == set(code + small)
    assert set(startup_files((pkg,), (model,))[: len(code)]) == set(code)  # the packages' files first
    for f in code + other + small + model_files(model):
        drop(f)
    done = read_in_child(model_files(model), packages=(pkg,), folders=(model,))
    assert done["first"]["files"] == len(code + small), done
    assert done["first"]["bytes"] == sum(f.stat().st_size for f in code + small)
    assert all(file_residency(f).ratio == 1.0 for f in code + small + model_files(model))
    assert all(file_residency(f).ratio < 1.0 for f in other)  # headers and text: not what a start reads
    folders = package_folders(START_PACKAGES + ("no_such_package_here", "json"))  # json: stdlib package
    assert folders[0].name == "diffusers" and all(f.is_dir() for f in folders)
    assert not any(f.name == "no_such_package_here" for f in folders)


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
