"""Start-up accounting: named laps, and which heavy packages a process compiled from source."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from dlo.engine.timing import Laps, uncached_bytecode


def test_laps_record_consecutive_intervals_in_order():
    laps = Laps(start=0.0)
    laps.lap("a")
    laps.lap("b")
    assert list(laps.phases) == ["a", "b"]
    assert laps.phases["a"] > 0 and laps.phases["b"] >= 0
    assert laps.rounded() == {k: round(v, 2) for k, v in laps.phases.items()}


def _package(tmp_path: Path) -> Path:
    pkg = tmp_path / "heavypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    return pkg


# The probes' interpreters: bytecode next to the sources whatever the caller's environment says.
ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}


def _probe(tmp_path: Path, write_bytecode: bool) -> list[str]:
    """uncached_bytecode() of a fresh interpreter that imports `heavypkg` from tmp_path."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import heavypkg
        sys.dont_write_bytecode = True  # the probe writes no bytecode of its own (dlo's tree)
        from dlo.engine.timing import uncached_bytecode
        print(",".join(uncached_bytecode(("heavypkg", "not_imported_pkg"))))
    """)
    flags = [] if write_bytecode else ["-B"]  # -B: as PYTHONDONTWRITEBYTECODE=1
    r = subprocess.run([sys.executable, *flags, "-c", code], capture_output=True, text=True, check=True, env=ENV)
    return [x for x in r.stdout.strip().split(",") if x]


def test_a_package_compiled_from_source_without_writing_bytecode_is_reported(tmp_path):
    pkg = _package(tmp_path)
    assert _probe(tmp_path, write_bytecode=False) == ["heavypkg"]  # and it will be compiled again next time
    # compiled at install, as pip does (in an interpreter with the probes' environment)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(pkg)], check=True, env=ENV)
    assert _probe(tmp_path, write_bytecode=False) == []


def test_a_process_that_writes_its_bytecode_is_not_reported(tmp_path):
    _package(tmp_path)
    assert _probe(tmp_path, write_bytecode=True) == []


def test_packages_not_imported_are_not_reported():
    assert uncached_bytecode(("a_package_nobody_imported_xyz",)) == []


def test_process_age_lies_between_what_the_parent_saw():
    """The age a process reports is at least the time it slept and at most the time its parent saw
    pass from before the start to after the answer (to the clock tick: 10 ms)."""
    import time

    code = "import time; time.sleep(0.5); from dlo.engine.timing import process_age_seconds; print(process_age_seconds())"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    seen = time.monotonic() - t0
    age = float(out.stdout)
    assert 0.5 - 0.011 <= age <= seen + 0.011, (age, seen)


def test_unneeded_optional_imports_are_the_imported_ones(monkeypatch):
    import types

    from dlo.engine.timing import unneeded_imports

    monkeypatch.setitem(sys.modules, "fakeoptional_a", types.ModuleType("fakeoptional_a"))  # as if installed
    assert unneeded_imports(("fakeoptional_a", "fakeoptional_b")) == ["fakeoptional_a"]
    assert unneeded_imports(("a_package_nobody_imported_xyz",)) == []


def test_a_server_that_imported_an_unneeded_package_says_so_once_at_ready(tmp_path, tmp_path_factory):
    """`dlo serve` names, at ready, the optional packages it imported only because they are
    installed (here a stand-in onnxruntime that the interpreter imports at start)."""
    from dlo.serving.launch import ServerProcess
    from tests.engine.serving_helpers import tiny_pipeline

    site = tmp_path / "site"
    (site / "onnxruntime").mkdir(parents=True)
    (site / "onnxruntime" / "__init__.py").write_text("")
    (site / "sitecustomize.py").write_text("import onnxruntime\n")
    env = {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    log = tmp_path / "serve.log"
    with ServerProcess(tiny_pipeline(tmp_path_factory, "wan"), "--device", "cpu", "--small-limits", "--no-warmup",
                       log_path=log, env=env):
        pass
    lines = [ln for ln in log.read_text().splitlines() if "imported only because installed" in ln]
    assert len(lines) == 1 and "WARNING dlo.serving.startup onnxruntime imported only" in lines[0], lines
