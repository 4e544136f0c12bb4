"""What a rank's start runs beside its imports (`dlo.serving.prewarm`): a cold checkpoint
read ahead into the page cache, and the device libraries' first calls."""

from __future__ import annotations

import os
from pathlib import Path

from dlo.pagecache.residency import folder_residency, model_files
from dlo.serving.prewarm import start_library_warmup, start_readahead, warm_libraries
from tests.agent.test_warm import drop  # fsync, then POSIX_FADV_DONTNEED
from tests.engine.serving_helpers import tiny_pipeline


def test_a_cold_checkpoint_is_read_ahead_and_a_warm_one_costs_nothing(tmp_path_factory):
    model = tiny_pipeline(tmp_path_factory, "wan")
    for f in model_files(model):
        drop(f)
    cold = folder_residency(model).ratio
    job = start_readahead(model, ("transformer", "text_encoder"), distributions=("safetensors",))
    assert job is not None
    done = job.join()
    assert done is not None and done["files"] == len(model_files(model)), done
    assert done["first"]["files"] > 1  # the distribution's code and the folder's configs, before the weights
    assert done["pid"] != os.getpid()  # read by a child: its threads never take the GIL of the rank's imports
    assert folder_residency(model).ratio == 1.0 > cold
    assert start_readahead(model, ("transformer",)) is None  # every file cached: no thread, no read


def test_a_registration_waits_until_the_readahead_has_read_its_file(tmp_path):
    """[Note: pin what is read]: `until_resident` returns once the child's read brought the file
    into the page cache; at once when the readahead has ended (whoever maps the file reads it) or
    the registration is released."""
    import threading
    import time

    from dlo.pagecache.residency import file_residency
    from dlo.serving.prewarm import RESIDENT_ENOUGH, Readahead

    weights = tmp_path / "w.safetensors"
    weights.write_bytes(os.urandom(8 << 20))
    drop(weights)
    assert file_residency(weights).ratio < RESIDENT_ENOUGH  # the page cache really dropped it
    go = threading.Event()

    def read():
        go.wait(30)
        return len(weights.read_bytes())

    job = Readahead(read, "one file")
    stop, waited = threading.Event(), []
    waiter = threading.Thread(target=lambda: waited.append(job.until_resident(weights, stop)))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not waited  # the file is not read yet: it waits
    go.set()
    waiter.join(30)
    assert waited and file_residency(weights).ratio >= RESIDENT_ENOUGH
    assert job.join() == 8 << 20

    drop(weights)  # the readahead has ended: nothing will read it for the registration
    t0 = time.perf_counter()
    job.until_resident(weights, stop)
    assert time.perf_counter() - t0 < 1.0
    go2, stop2 = threading.Event(), threading.Event()
    job2 = Readahead(lambda: go2.wait(30), "never reads it")
    stop2.set()  # released: it does not wait for a read that would come
    t0 = time.perf_counter()
    job2.until_resident(weights, stop2)
    assert time.perf_counter() - t0 < 1.0
    go2.set()
    job2.join()


def test_the_readahead_reads_the_starts_code_and_small_files_before_the_weights(tmp_path_factory, tmp_path):
    from dlo.pagecache.residency import file_residency
    from dlo.serving.prewarm import package_folders
    from dlo.serving.readahead import read_in_child, startup_files

    pkg = tmp_path / "pkg"
    (pkg / "__pycache__").mkdir(parents=True)
    code = [pkg / "a.py", pkg / "__pycache__" / "a.cpython-311.pyc", pkg / "libx.so.9", pkg / "_c.so"]
    other = [pkg / "x.h", pkg / "notes.txt"]
    for i, f in enumerate(code + other):
        f.write_bytes(bytes([i]) * (4096 * (i + 1)))
    import shutil

    model = shutil.copytree(tiny_pipeline(tmp_path_factory, "wan"), tmp_path / "model")
    small = [f for f in sorted(model.rglob("*")) if f.is_file() and f.suffix != ".safetensors"]
    (model / ".cache" / "huggingface").mkdir(parents=True)  # a download's leftovers: not read first
    (model / ".cache" / "huggingface" / "x.safetensors.incomplete").write_bytes(b"partial download")
    with open(model / "flax_model.msgpack", "wb") as big:  # another format's weights, 65 MiB (sparse): nor these
        big.truncate(65 << 20)
    assert small and set(startup_files((pkg,), (model,))) == set(code + small)
    assert set(startup_files((pkg,), (model,))[: len(code)]) == set(code)  # the packages' files first
    for f in code + other + small + model_files(model):
        drop(f)
    done = read_in_child(model_files(model), packages=(pkg,), folders=(model,))
    assert done["first"]["files"] == len(code + small), done
    assert done["first"]["bytes"] == sum(f.stat().st_size for f in code + small)
    assert all(file_residency(f).ratio == 1.0 for f in code + small + model_files(model))
    assert all(file_residency(f).ratio < 1.0 for f in other)  # headers and text: not what a start reads
    folders = package_folders(("diffusers", "no_such_package_here", "json"))  # json: stdlib package
    assert folders[0].name == "diffusers" and all(f.is_dir() for f in folders)
    assert not any(f.name == "no_such_package_here" for f in folders)


def test_the_distributions_a_start_imports_are_read_with_what_they_require(tmp_path_factory, tmp_path, monkeypatch):
    """`--distribution`: a distribution's installed files (its RECORD) and those of its requirements,
    transitively; a requirement of an extra or for another platform, and a file gone, are left out."""
    from dlo.serving.prewarm import START_DISTRIBUTIONS
    from dlo.serving.readahead import distribution_files, read_in_child, startup_files

    site = tmp_path / "site"

    def dist(name: str, files: list[str], requires: list[str]) -> list:
        info = site / f"{name.replace('-', '_')}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
                                       + "".join(f"Requires-Dist: {r}\n" for r in requires))
        (info / "RECORD").write_text("".join(f"{f},,\n" for f in files))
        for f in files[:-1] if files else ():  # the last one listed is not there
            (site / f).parent.mkdir(parents=True, exist_ok=True)
            (site / f).write_bytes(b"x" * 100)
        return [site / f for f in files[:-1]]

    a = dist("app-a", ["app_a/__init__.py", "app_a/_c.so", "app_a/gone.py"], ["lib-b>=1", "lib-c; extra == 'dev'",
                                                                               "lib-d; python_version < '3'"])
    b = dist("lib-b", ["lib_b/core.py", "lib_b/libb.so.2", "lib_b/gone.py"], ["app-a"])  # a cycle ends
    dist("lib-c", ["lib_c/x.py", "lib_c/gone.py"], [])
    dist("lib-d", ["lib_d/x.py", "lib_d/gone.py"], [])
    from importlib.util import cache_from_source

    pyc = Path(cache_from_source(str(a[0])))  # compiled after the install: not in the RECORD
    pyc.parent.mkdir()
    pyc.write_bytes(b"x")
    assert distribution_files(("app_a",), path=[str(site)]) == [a[0], pyc, *a[1:], *b]
    assert distribution_files(("not-installed",), path=[str(site)]) == []
    # the child looks where this process does (the GPU host's wheels sit on PYTHONPATH-only folders)
    monkeypatch.syspath_prepend(str(site))
    done = read_in_child(model_files(tiny_pipeline(tmp_path_factory, "wan")), distributions=("app-a",))
    assert done["first"]["files"] == len(a + b) + 1  # and the bytecode
    # here: torch requires sympy and filelock, among others
    found = {p.name for p in startup_files((), (), START_DISTRIBUTIONS)}
    assert {"__init__.py"} <= found and any(n.endswith(".so") or ".so." in n for n in found)
    assert any("sympy" in p.parts for p in startup_files((), (), ("torch",)))


def test_a_starts_readahead_reads_the_interpreters_modules_the_metadata_and_the_projects_own_first(tmp_path_factory, tmp_path):
    """What a start's imports read besides its libraries' RECORDs (a trace found them queued behind
    the weights on a cold node): the standard library's bytecode, every distribution's metadata, the
    project's own modules; the standard library's test suite and nested site-packages are not read."""
    import importlib.metadata
    import shutil
    import sysconfig
    from importlib.util import cache_from_source

    import dlo.serving.readahead as ra
    from dlo.pagecache.residency import file_residency

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tabnanny = Path(cache_from_source(str(stdlib / "tabnanny.py")))  # a module no start imports
    tabnanny = tabnanny if tabnanny.is_file() else stdlib / "tabnanny.py"
    metadata = Path(str(importlib.metadata.distribution("kopf").locate_file(
        next(f for f in importlib.metadata.distribution("kopf").files if f.name == "METADATA"))))
    import dlo.engine.families as families

    own = Path(families.__file__)  # dlo.engine's, no RECORD lists it
    from dlo.serving.prewarm import START_DISTRIBUTIONS, START_FOLDERS, package_folders

    first = set(ra.startup_files(package_folders(START_FOLDERS), (), START_DISTRIBUTIONS, python=True))
    assert {tabnanny, metadata, own} <= first  # what a start reads first, whatever the page cache holds
    files = ra.interpreter_files()
    assert tabnanny in files and not any({"test", "site-packages"} & set(f.relative_to(stdlib).parts[:-1])
                                         for f in files if f.is_relative_to(stdlib))
    assert metadata in ra.metadata_files()
    model = shutil.copytree(tiny_pipeline(tmp_path_factory, "wan"), tmp_path / "model")
    for f in (tabnanny, metadata, own, *model_files(model)):
        drop(f)
    job = start_readahead(model, ("transformer",))
    done = job.join()
    assert done["first"]["files"] > 1000, done  # the standard library alone is thousands of modules
    # this interpreter's code is cached (the sample says so): of the three only the metadata, not
    # code, is read beside the weights; a cold set is read first whole (the test above)
    assert done["first"]["cached"] is True and file_residency(metadata).ratio == 1.0, done


def _package(root: Path, modules: int) -> tuple[list[Path], Path]:
    """A package of `modules` Python files (8 KiB each) and a library (8 MiB), all out of the page cache."""
    root.mkdir()
    code = [root / f"m{i}.py" for i in range(modules)]
    for f in code:
        f.write_bytes(b"x" * 8192)
    lib = root / "_c.cpython-311-x86_64-linux-gnu.so"
    lib.write_bytes(os.urandom(8 << 20))
    for f in (*code, lib):
        drop(f)
    return code, lib


def _run(files: list[Path], share: float = 0.0) -> None:
    """What a start does to its code: imports `share` of the modules (reads them whole) and maps the
    library, faulting in a few of its pages."""
    modules, lib = files[:-1], files[-1]
    for f in modules[: round(share * len(modules))]:
        f.read_bytes()
    with open(lib, "rb") as fh:
        fh.read(256 << 10)


def test_code_a_start_ran_counts_as_cached_and_only_the_folders_files_are_read_beside(tmp_path_factory, tmp_path):
    """[Note: first files already cached]: after warm starts only the modules they imported and the
    pages of the libraries they ran are resident; that counts as cached (the child says so at once,
    the registration starts) and the child reads beside the weights only the folder's small files,
    none of the code no start read. A page cache dropped since is cold: everything is read first."""
    import shutil

    from dlo.pagecache.residency import file_residency
    from dlo.serving.first_cached import USED_SHARE, looks_cached
    from dlo.serving.readahead import read_in_child

    code, lib = _package(tmp_path / "pkg", 40)
    assert not looks_cached([*code, lib])  # a dropped page cache
    _run([*code, lib], share=0.15)  # a Wan2.1 rank imports ~16% of its Python files' bytes
    assert looks_cached([*code, lib]) and USED_SHARE < 0.15
    model = shutil.copytree(tiny_pipeline(tmp_path_factory, "wan"), tmp_path / "model")
    for f in model.rglob("*"):
        if f.is_file():
            drop(f)
    done = read_in_child(model_files(model), packages=(tmp_path / "pkg",), folders=(model,))
    first = done["first"]
    assert first["cached"] is True and first["bytes"] == 0, first
    assert first["sample"]["libraries_touched"] == first["sample"]["libraries"] == 1
    assert folder_residency(model).ratio == 1.0  # the weights, then the configs read beside them
    assert (model / "model_index.json").read_bytes() and file_residency(model / "model_index.json").ratio == 1.0
    assert 0 < first["behind"]["files"] < len(list(model.rglob("*")))  # the folder's small files only
    assert file_residency(code[-1]).ratio == 0.0 and file_residency(lib).ratio < 0.5  # unused code: not read

    for f in (*code, lib, *model_files(model)):  # the whole page cache dropped: cold, read first
        drop(f)
    done = read_in_child(model_files(model), packages=(tmp_path / "pkg",))
    assert "cached" not in done["first"] and done["first"]["bytes"] == 8192 * len(code) + (8 << 20)


def test_python_files_cached_with_no_library_touched_are_cold(tmp_path):
    """The libraries dropped while the Python files stayed: the code is not all there, read first."""
    from dlo.serving.first_cached import looks_cached, sample_facts

    code, lib = _package(tmp_path / "pkg", 20)
    for f in code:
        f.read_bytes()
    facts = sample_facts([*code, lib])
    assert not facts["cached"] and facts["libraries_touched"] == 0 and facts["rest_resident_share"] == 1.0
    _run([*code, lib])
    assert looks_cached([*code, lib])
    assert looks_cached(code)  # no library listed: the Python files alone decide

def test_the_library_warmup_runs_its_calls_and_only_starts_on_cuda():
    assert warm_libraries("cpu") > 0
    assert start_library_warmup(__import__("torch").device("cpu")) is None


def test_rank_zeros_load_adopts_the_library_warmup_dlo_serve_started(tmp_path, monkeypatch):
    """`dlo serve` starts rank 0's library warm-up with its checks (`start_early_library_warmup`);
    the load on that device adopts it once, any other device's load, or a later one, starts its own.
    (The warm-up starts only on cuda: here it runs its calls on cpu.)"""
    from dlo.serving import prewarm

    started: list[str] = []

    def start(device):
        started.append(str(device))
        return prewarm.Background("library-warmup", lambda: warm_libraries(device))

    monkeypatch.setattr(prewarm, "start_library_warmup", start)
    monkeypatch.setattr(prewarm, "_EARLY_LIBRARIES", {})
    prewarm.start_early_library_warmup("cpu")
    early = prewarm._EARLY_LIBRARIES["cpu"]
    _, adopted = prewarm.start_beside_imports(tmp_path, (), __import__("torch").device("cpu"))
    assert adopted is early and started == ["cpu"] and adopted.join() > 0
    _, again = prewarm.start_beside_imports(tmp_path, (), __import__("torch").device("cpu"))
    assert again is not early and started == ["cpu", "cpu"]
    again.join()
    # a start refused after its warm-up began waits for it before it exits
    prewarm.start_early_library_warmup("cpu")
    refused = prewarm._EARLY_LIBRARIES["cpu"]
    prewarm.end_early_library_warmups()
    assert prewarm._EARLY_LIBRARIES == {} and not refused._thread.is_alive() and refused.result > 0


def test_a_readahead_that_cannot_read_says_why_and_an_orphan_reads_nothing(tmp_path):
    import subprocess
    import sys

    import pytest

    from dlo.serving.readahead import ReadaheadError, read_in_child

    with pytest.raises(ReadaheadError, match="the readahead process failed: .*no such file"):
        read_in_child([tmp_path / "gone.safetensors"])
    # a child whose parent is not the one named (it went before the death signal was armed) exits
    # at once, torch never imported
    code = ("import sys; from dlo.serving.readahead import main; "
            "rc = main(['--parent-pid', '1', '/nonexistent.safetensors']); print(rc, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["1", "False"], out.stderr[-2000:]


def test_dlo_serve_reads_a_cold_folder_ahead_from_its_first_checks_and_the_load_adopts_that_read(tmp_path_factory, tmp_path):
    """The readahead starts with `dlo serve`'s checks, before the device (and torch) is touched: the
    mode line comes after it, and rank 0's load joins that same read instead of starting another."""
    from dlo.serving.launch import ServerProcess
    from tests.engine.serving_helpers import offline_env

    model = tiny_pipeline(tmp_path_factory, "wan")
    for f in model_files(model):
        drop(f)
    log = tmp_path / "serve.log"
    with ServerProcess(model, "--dp", "1", "--mode", "rank-local", "--device", "cpu", "--small-limits",
                       log_path=log, env=offline_env()) as srv:
        assert srv.ready_info()["ready"] is True
    lines = log.read_text().splitlines()
    adopted = [line for line in lines if "readahead of" in line and "adopted (started with dlo serve's checks" in line]
    assert len(adopted) == 1 and not [line for line in lines if "readahead of" in line and "started" in line.split()[-1]]
    assert float(adopted[0].split(", ")[-1].split()[0]) > 0  # seconds before the load
    assert any("readahead done" in line for line in lines)  # the load joined it
    assert folder_residency(model).ratio == 1.0


def test_a_first_file_that_cannot_be_read_leaves_the_rest_to_be_read(tmp_path, monkeypatch, capsys):
    """The first phase is best effort: one file's read error is reported, the others are read."""
    import dlo.pagecache.warm as warm
    from dlo.serving.readahead import read_first

    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_bytes(b"g" * 5000)
    bad.write_bytes(b"b" * 7000)
    real = warm.read_range

    def failing(path, start, length):
        if path == bad:
            raise OSError(5, "Input/output error")
        return real(path, start, length)

    monkeypatch.setattr(warm, "read_range", failing)
    done = read_first([bad, good, tmp_path / "gone.py"], threads=2)
    assert done["files"] == 3 and done["bytes"] == 5000
    assert "could not read 1 of its first files" in capsys.readouterr().err
