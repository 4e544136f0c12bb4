"""pagecache/tree.py: a model folder's files with a bounded walk, whatever the recursion limit."""

import sys
from pathlib import Path

import pytest
from tests.agent.conftest import write_wan_folder

from dlo.agent.topology import model_folders
from dlo.pagecache.tree import FolderTooDeep, walk_files


def test_the_files_of_a_pipeline_folder_are_those_rglob_lists(tmp_path: Path) -> None:
    folder = write_wan_folder(tmp_path / "wan")
    (folder / "transformer" / "notes.txt").write_text("x")
    (folder / "loop").symlink_to(folder, target_is_directory=True)  # never followed
    want = sorted(p for p in folder.rglob("*.safetensors"))
    assert sorted(walk_files(folder, (".safetensors",))) == want and want
    assert folder / "transformer" / "notes.txt" in set(walk_files(folder))


def test_a_too_deep_folder_is_a_scan_error_even_with_torchs_recursion_limit(tmp_path: Path, deep_tree) -> None:
    root = tmp_path / "models"
    write_wan_folder(root / "good")
    deep_tree(write_wan_folder(root / "deep") / "transformer" / "deep")
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 100_000))  # what importing torch._dynamo does, higher: rglob would walk it
    try:
        with pytest.raises(FolderTooDeep):
            list(walk_files(root / "deep"))
        found = {m.name: m for m in model_folders(root)}
    finally:
        sys.setrecursionlimit(old)
    assert found["good"].error is None
    assert found["deep"].error is not None and found["deep"].error.reason == "scan_error"
    assert "deeper than" in found["deep"].error.message
