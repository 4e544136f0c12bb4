"""`hf://` resolution offline, through huggingface_hub's own cache functions: a cache that
`scan_cache_dir` accepts (blobs named by checksum, snapshot links, refs) resolves to its snapshot
with no network, `dlo fetch` publishes a verified copy of it, and a tampered blob is refused.

The download path itself (`snapshot_download` from the Hub or a mirror) is the library's and needs
the network: it cannot be exercised here (no network in tests) and is not."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from dlo.delivery.errors import SourceRefused
from dlo.delivery.fetch import FetchOptions, model_folder
from dlo.delivery.progress import Progress
from dlo.delivery.staging import staging_dir
from tests.delivery.conftest import dlo_fetch, files_of, result_of
from tests.delivery.test_fetch_hostile import one_line

REPO = "dlo-tests/tiny-wan"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def write_hf_cache(cache: Path, repo: str, commit: str, folder: Path) -> Path:
    """`folder` as revision `commit` (branch main) of `repo` in a Hugging Face cache, laid out as the
    library lays it out: blobs named by their SHA-256 (LFS files) or git SHA-1, relative links."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        data = path.read_bytes()
        blob = hashlib.sha256(data).hexdigest() if path.suffix == ".safetensors" else git_blob_sha1(data)
        (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
        (repo_dir / "blobs" / blob).write_bytes(data)
        link = snapshot / path.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(repo_dir / "blobs" / blob, link.parent))
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture()
def hf_cache(tiny_model, tmp_path) -> Path:
    from huggingface_hub import scan_cache_dir

    cache = tmp_path / "hf-cache"
    write_hf_cache(cache, REPO, COMMIT, tiny_model)
    info = scan_cache_dir(cache)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert repo.repo_id == REPO and [r.commit_hash for r in repo.revisions] == [COMMIT]
    assert {r.refs for r in repo.revisions} == {frozenset({"main"})}
    return cache


def offline(cache: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "DLO_LOG_LEVEL": "WARNING"}


def test_a_cached_revision_is_fetched_offline_verified_and_byte_identical(hf_cache, tiny_model, tmp_path):
    dest = tmp_path / "models" / "tiny"
    proc = dlo_fetch(f"hf://{REPO}", str(dest), "--json", env=offline(hf_cache))
    assert proc.returncode == 0, proc.stderr
    assert files_of(dest) == files_of(tiny_model)
    result = result_of(proc)
    assert result["state"] == "complete" and result["files"] == len(files_of(tiny_model))
    # linked from the cache's blobs, not copied
    weights = dest / "transformer" / "diffusion_pytorch_model.safetensors"
    blob = (hf_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT / weights.relative_to(dest)).resolve()
    assert weights.stat().st_ino == blob.stat().st_ino
    again = dlo_fetch(f"hf://{REPO}@main", str(dest), "--json", env=offline(hf_cache))
    assert again.returncode == 0 and result_of(again)["already_complete"] is True


def test_a_fetch_of_a_complete_folder_says_so_in_one_line(hf_cache, tmp_path):
    dest = tmp_path / "models" / "tiny"
    assert dlo_fetch(f"hf://{REPO}", str(dest), "--progress", "none", env=offline(hf_cache)).returncode == 0
    again = dlo_fetch(f"hf://{REPO}", str(dest), env=offline(hf_cache))
    assert again.returncode == 0 and again.stdout == ""
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dlo fetch: {dest} is already complete ("), again.stderr
    assert f" MB of hf://{REPO}@main): nothing to download" in lines[0], lines[0]


def test_serving_a_cached_repo_id_resolves_to_its_snapshot_without_copying(hf_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    folder = model_folder(f"hf://{REPO}@{COMMIT}", tmp_path / "dlo-cache", Progress("none"),
                          FetchOptions(hf_cache=hf_cache))
    assert folder == hf_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    assert not (tmp_path / "dlo-cache").exists()


def test_a_tampered_cache_blob_fails_its_checksum_and_nothing_is_published(hf_cache, tmp_path):
    snapshot = hf_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT
    blob = (snapshot / "vae" / "diffusion_pytorch_model.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF
    blob.write_bytes(bytes(data))
    dest = tmp_path / "models" / "tiny"
    proc = dlo_fetch(f"hf://{REPO}", str(dest), env=offline(hf_cache))
    assert proc.returncode == 1
    assert "verify:" in proc.stderr and "vae/diffusion_pytorch_model.safetensors" in proc.stderr
    assert not dest.exists()


def test_a_repo_missing_from_the_cache_offline_is_a_clear_error(hf_cache, tmp_path):
    dest = tmp_path / "models" / "other"
    proc = dlo_fetch("hf://dlo-tests/not-cached", str(dest), env=offline(hf_cache))
    assert proc.returncode == 1
    assert "not_found:" in proc.stderr and "HF_HUB_OFFLINE" in proc.stderr
    assert not dest.exists() and not staging_dir(dest).exists()


@pytest.mark.parametrize("ref", ["relative", "absolute"])
def test_a_local_ref_that_holds_a_path_is_refused_not_followed(hf_cache, tiny_model, tmp_path, ref, monkeypatch):
    """`refs/<revision>` in the local cache is a commit hash; one holding a path (a planted file)
    must not make another folder the model `dlo serve` serves in place, or `dlo fetch` copies."""
    outside = tmp_path / "outside"
    shutil.copytree(tiny_model, outside)
    (outside / "planted.txt").write_text("not the model's")
    repo = hf_cache / f"models--{REPO.replace('/', '--')}"
    target = os.path.relpath(outside, repo / "snapshots") if ref == "relative" else str(outside)
    (repo / "refs" / "evil").write_text(target)
    dest = tmp_path / "models" / "tiny"
    proc = dlo_fetch(f"hf://{REPO}@evil", str(dest), env=offline(hf_cache))
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc.stderr)
    assert line.startswith("dlo fetch: invalid: ") and "refs/ file holds a path" in line, line
    assert not dest.exists()
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SourceRefused, match="refs/ file holds a path"):  # `dlo serve hf://...@evil`
        model_folder(f"hf://{REPO}@evil", tmp_path / "dlo-cache", Progress("none"), FetchOptions(hf_cache=hf_cache))
