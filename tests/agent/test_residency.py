"""dlo.pagecache.residency: cachestat and mincore agree with what the page cache really holds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dlo.pagecache.residency import (
    PAGE,
    Mapping,
    ResidencyError,
    file_residency,
    folder_residency,
    model_files,
)

MiB = 1 << 20


def write_uncached(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    drop(path)
    return path


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_range(path: Path, start: int, length: int) -> None:
    with open(path, "rb") as f:
        f.seek(start)
        f.read(length)


@pytest.mark.parametrize("method", ["cachestat", "mincore"])
def test_residency_follows_reads_and_drops(tmp_path: Path, method: str) -> None:
    f = write_uncached(tmp_path / "a.safetensors", 8 * MiB)
    assert file_residency(f, method).resident_bytes == 0
    read_range(f, 0, 2 * MiB)
    r = file_residency(f, method)
    assert r.method == method
    # readahead may bring in more than was read, never less
    assert 2 * MiB <= r.resident_bytes <= 8 * MiB
    read_range(f, 0, 8 * MiB)
    assert file_residency(f, method).ratio == 1.0
    drop(f)
    assert file_residency(f, method).resident_bytes == 0


def test_both_methods_agree_on_a_partly_cached_file(tmp_path: Path) -> None:
    f = write_uncached(tmp_path / "a.safetensors", 16 * MiB)
    fd = os.open(f, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: exactly what we read
        os.pread(fd, 3 * MiB, 4 * MiB)
    finally:
        os.close(fd)
    a, b = file_residency(f, "cachestat"), file_residency(f, "mincore")
    assert a.resident_bytes == b.resident_bytes
    assert a.resident_bytes >= 3 * MiB


def test_mincore_leaves_the_cache_untouched(tmp_path: Path) -> None:
    f = write_uncached(tmp_path / "a.safetensors", 4 * MiB)
    for _ in range(3):
        assert file_residency(f, "mincore").resident_bytes == 0


def test_odd_sized_file_is_capped_at_its_size(tmp_path: Path) -> None:
    f = tmp_path / "odd.safetensors"
    f.write_bytes(b"x" * (PAGE + 7))
    read_range(f, 0, PAGE + 7)
    r = file_residency(f)
    assert r.bytes == PAGE + 7 and r.resident_bytes == PAGE + 7 and r.ratio == 1.0


def test_empty_file_is_fully_resident(tmp_path: Path) -> None:
    f = tmp_path / "empty.safetensors"
    f.touch()
    assert file_residency(f, "mincore").ratio == 1.0
    assert file_residency(f).ratio == 1.0


def test_missing_file_raises_residency_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ResidencyError) as err:
        file_residency(tmp_path / "gone.safetensors")
    assert "gone.safetensors" in str(err.value)


def test_model_files_finds_safetensors_recursively(tmp_path: Path) -> None:
    (tmp_path / "transformer").mkdir()
    for name in ("transformer/a.safetensors", "transformer/b.safetensors", "vae.safetensors", "config.json"):
        (tmp_path / name).write_bytes(b"0")
    assert [p.name for p in model_files(tmp_path)] == ["a.safetensors", "b.safetensors", "vae.safetensors"]
    assert model_files(tmp_path / "vae.safetensors") == [tmp_path / "vae.safetensors"]
    with pytest.raises(FileNotFoundError):
        model_files(tmp_path / "nope")


def test_folder_residency_sums_files_and_reports_the_weakest(tmp_path: Path) -> None:
    a = write_uncached(tmp_path / "a.safetensors", 2 * MiB)
    write_uncached(tmp_path / "b.safetensors", 2 * MiB)
    read_range(a, 0, 2 * MiB)
    r = folder_residency(tmp_path)
    assert r.bytes == 4 * MiB and r.resident_bytes == 2 * MiB
    assert r.ratio == 0.5 and r.min_ratio == 0.0


def test_mapping_lock_keeps_pages_resident(tmp_path: Path) -> None:
    f = write_uncached(tmp_path / "a.safetensors", 4 * MiB)
    with Mapping(f) as m:
        m.lock()  # faults every page in
        assert file_residency(f).ratio == 1.0
        drop(f)  # locked pages cannot be dropped
        assert file_residency(f).ratio == 1.0
    drop(f)
    assert file_residency(f).resident_bytes == 0
