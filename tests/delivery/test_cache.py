"""The node cache: least recently served models are evicted to fit a disk budget and the free space,
never one in use (`--keep`) nor a folder someone copied by hand; a disk that cannot hold the model
is refused before the download starts, with nothing evicted."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from dlo.delivery.cache import SERVED, cached_models, make_room
from dlo.delivery.errors import FetchError
from dlo.delivery.staging import MANIFEST
from tests.delivery.conftest import dlo_fetch, files_of, result_of, upload

pytestmark = pytest.mark.slow


def published(root: Path, key: str, size: int, served_ago_s: float) -> Path:
    folder = root / key
    folder.mkdir(parents=True)
    (folder / "weights.bin").write_bytes(b"\0" * size)
    (folder / MANIFEST).write_text(json.dumps({"uri": f"s3://b/{key}", "bytes": size, "files": {}}))
    (folder / SERVED).touch()
    stamp = time.time() - served_ago_s
    os.utime(folder / SERVED, (stamp, stamp))
    return folder


def test_eviction_takes_the_least_recently_served_model_not_in_use(tmp_path):
    root = tmp_path / "cache"
    published(root, "old", 400, served_ago_s=3000)
    published(root, "older-in-use", 400, served_ago_s=9000)
    published(root, "recent", 400, served_ago_s=10)
    (root / "hand-copied").mkdir()
    (root / "hand-copied" / "weights.bin").write_bytes(b"\0" * 4000)
    assert [m.key for m in cached_models(root)] == ["older-in-use", "old", "recent"]
    evicted = make_room(root, root / "new", total=500, remaining=500, budget=1000, keep={"older-in-use"})
    assert evicted == ["old", "recent"]  # 1200 + 500 over 1000: the two unused ones, oldest first
    assert sorted(p.name for p in root.iterdir()) == ["hand-copied", "older-in-use"]


def test_a_budget_that_only_models_in_use_exceed_is_refused_and_nothing_is_evicted(tmp_path):
    root = tmp_path / "cache"
    published(root, "a", 600, served_ago_s=100)
    published(root, "b", 600, served_ago_s=50)
    with pytest.raises(FetchError) as e:
        make_room(root, root / "new", total=500, remaining=500, budget=1000, keep={"a", "b"})
    assert e.value.reason == "disk_budget" and "a, b" in str(e.value)
    assert sorted(p.name for p in root.iterdir()) == ["a", "b"]


@contextlib.contextmanager
def small_disk(path: Path, size: str):
    """A tmpfs of `size` at `path` (the tests run as root, as CI does)."""
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_disk_too_small_is_refused_before_the_download_with_nothing_at_dest(s3, tiny_model, tmp_path):
    upload(s3.client(), tiny_model, "models", "disk/tiny-wan")
    with small_disk(tmp_path / "disk", "640k") as disk:
        dest = disk / "tiny-wan"
        proc = dlo_fetch("s3://models/disk/tiny-wan", str(dest), "--endpoint", s3.url, "--json", env=s3.env())
        assert proc.returncode == 1, proc.stderr
        assert "disk_full:" in proc.stderr and "bytes free" in proc.stderr
        assert result_of(proc)["reason"] == "disk_full"
        assert not dest.exists()


def test_fetch_with_a_budget_evicts_an_unused_model_and_keeps_the_one_in_use(s3, tiny_model, tmp_path):
    upload(s3.client(), tiny_model, "models", "budget/one")
    upload(s3.client(), tiny_model, "models", "budget/two")
    upload(s3.client(), tiny_model, "models", "budget/three")
    root = tmp_path / "cache"
    size = sum(len(b) for b in files_of(tiny_model).values())
    for name in ("one", "two"):
        assert dlo_fetch(f"s3://models/budget/{name}", str(root / name), "--endpoint", s3.url,
                         env=s3.env()).returncode == 0
    # "one" is served (in use on this node): it is kept though it was fetched first
    proc = dlo_fetch("s3://models/budget/three", str(root / "three"), "--endpoint", s3.url, "--keep", "one",
                     "--disk-budget", str(2 * size + 1000), "--json", env=s3.env())
    assert proc.returncode == 0, proc.stderr
    assert result_of(proc)["evicted"] == ["two"]
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["one", "three"]
    assert files_of(root / "three") == files_of(tiny_model)


def test_the_agent_reports_a_published_fetch_but_not_its_staging_folder(tiny_model, tmp_path):
    """A fetch in progress sits in `.<key>.partial` beside its destination under the models root:
    the agent's scan must not flag it as a broken model (dlo_model_error) while it downloads."""
    import shutil

    from dlo.agent.topology import model_folders
    from dlo.delivery.staging import staging_dir

    root = tmp_path / "models"
    shutil.copytree(tiny_model, root / "tiny-wan-0123456789ab")
    shutil.copytree(tiny_model / "vae", staging_dir(root / "other-0123456789ab") / "vae")  # half a pipeline
    found = model_folders(root)
    assert [f.name for f in found] == ["tiny-wan-0123456789ab"]
    assert found[0].error is None
