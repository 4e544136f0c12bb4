"""The distribution map a rank's start computes beside its imports (`dlo.serving.distmap`):
the same map `importlib.metadata` gives, served only while the rank loads, and a start that goes on
without it."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

from dlo.serving import distmap


def test_the_childs_map_is_importlibs_own_and_is_served_only_while_the_rank_loads(monkeypatch):
    monkeypatch.setattr(distmap, "_started", None)
    expected = importlib.metadata.packages_distributions()
    original = importlib.metadata.packages_distributions
    distmap.start_distribution_map()
    child = distmap._started
    assert child is not None and child._proc.pid != os.getpid()  # a process of its own
    with distmap.installed():
        served = importlib.metadata.packages_distributions()
        assert importlib.metadata.packages_distributions is not original
        assert served == expected and "torch" in served and child.found == expected  # the child's answer
        served["torch"].append("changed by a caller")
        assert importlib.metadata.packages_distributions() == expected  # each caller gets its own copy
    assert importlib.metadata.packages_distributions is original
    assert distmap._started is None  # used once: the next load starts afresh
    assert child._proc.poll() == 0  # reaped


def test_without_the_child_the_map_is_computed_once_in_process(monkeypatch):
    monkeypatch.setattr(distmap, "_started", None)
    calls = []
    original = importlib.metadata.packages_distributions

    def counted():
        calls.append(1)
        return original()

    monkeypatch.setattr(importlib.metadata, "packages_distributions", counted)
    with distmap.installed():  # no child started
        assert calls == []  # asked for on the first call only
        assert importlib.metadata.packages_distributions() == importlib.metadata.packages_distributions()
    assert len(calls) == 1 and importlib.metadata.packages_distributions is counted


def test_a_child_that_fails_costs_only_what_it_would_have_saved(monkeypatch, caplog):
    monkeypatch.setattr(distmap, "_started", None)
    monkeypatch.setattr(distmap, "_CHILD", "import sys; sys.exit(3)")
    distmap.start_distribution_map()
    expected = importlib.metadata.packages_distributions()
    with caplog.at_level("WARNING", logger="dlo.serving.distmap"), distmap.installed():
        assert importlib.metadata.packages_distributions() == expected  # computed here instead
    assert "exited with code 3" in caplog.text


def test_a_function_replaced_during_the_window_is_left_in_place(monkeypatch):
    monkeypatch.setattr(distmap, "_started", None)
    original = importlib.metadata.packages_distributions

    def other():
        return {}

    try:
        with distmap.installed():
            importlib.metadata.packages_distributions = other
        assert importlib.metadata.packages_distributions is other  # not ours to undo
    finally:
        importlib.metadata.packages_distributions = original


def test_the_child_sees_the_paths_of_this_process(tmp_path):
    """A folder on this process's `sys.path` only (as `PYTHONPATH` or `--target` installs put the
    GPU host's wheels) is where the child looks too."""
    info = tmp_path / "only_here-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: only-here\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("only_here\n")
    code = ("import sys, importlib.metadata; sys.path.insert(0, sys.argv[1]); from dlo.serving import distmap; "
            "distmap.start_distribution_map()\nwith distmap.installed(): "
            "print(importlib.metadata.packages_distributions().get('only_here'))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "['only-here']", out.stderr[-2000:]
