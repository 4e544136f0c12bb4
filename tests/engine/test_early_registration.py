"""Registering the page cache early (`EarlyRegistration`): what the host weights adopt, what is
released, and the fallbacks. The platform here records the driver calls (CPU has no DMA
registration); the CUDA path is measured on the GPU (bench/NOTES.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dlo.engine.checkpoint import cached_checkpoint
from dlo.engine.families import block_layout
from dlo.engine.families.tiny import make_tiny_transformer
from dlo.engine.model import build_meta_model
from dlo.engine.platform import Platform
from dlo.engine.weights import EarlyRegistration, prepare_host_weights


class RecordingPlatform(Platform):
    """The CPU platform, plus a driver that registers host ranges: it records every call and
    refuses (or raises for) the files named."""

    has_streams = True

    def __init__(self, refuse: int | None = None, fail: int | None = None):
        self.refuse, self.fail = refuse, fail
        self.live: dict[int, int] = {}  # ptr -> bytes currently registered
        self.calls = 0

    def register_read_only(self, ptr: int, nbytes: int) -> bool:
        self.calls += 1
        if self.calls == self.fail:
            raise RuntimeError("driver error")
        if self.calls == self.refuse:
            return False
        assert ptr not in self.live, "a range registered twice"
        self.live[ptr] = nbytes
        return True

    def unregister(self, ptr: int) -> None:
        assert ptr in self.live, "unregistering a range that is not registered"
        del self.live[ptr]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A tiny transformer in several safetensors files."""
    path = make_tiny_transformer(tmp_path_factory.mktemp("early") / "transformer", layers=3, max_shard_size=20_000)
    assert len(cached_checkpoint(path).files) >= 3
    return path


def _layouts(path: Path):
    ckpt = cached_checkpoint(path)
    meta = build_meta_model(path, ckpt)
    return meta, [block_layout(ckpt, b, meta.target_dtype) for b in meta.blocks]


def test_adopt_keeps_the_files_asked_for_and_unregisters_the_rest(sharded):
    platform = RecordingPlatform()
    early = EarlyRegistration(cached_checkpoint(sharded), platform, torch.device("cpu"))
    assert early.wait() and len(platform.live) == len(early.ckpt.files)
    first = early.ckpt.files[0]
    kept = early.adopt({first})
    whole = early.ckpt.file_bytes(first)
    assert kept == [(whole.data_ptr(), whole.numel())] and platform.live == {whole.data_ptr(): whole.numel()}
    early.release()  # the adopted registration is the caller's now
    assert platform.live == {whole.data_ptr(): whole.numel()}


def test_host_weights_adopt_the_early_registrations_of_their_files(sharded):
    meta, layouts = _layouts(sharded)
    platform = RecordingPlatform()
    early = EarlyRegistration(cached_checkpoint(sharded), platform, torch.device("cpu"))
    hw = prepare_host_weights(early.ckpt, layouts, meta.target_dtype, 1, 0, platform, "auto", early)
    assert hw.source == "registered" and hw.pinned
    used = {early.ckpt.tensors[k].path for b in meta.blocks for k in b.keys}
    expected = {early.ckpt.file_bytes(p).data_ptr(): early.ckpt.file_bytes(p).numel() for p in used}
    assert platform.live == expected and hw.pinned_bytes == sum(expected.values())
    assert platform.calls == len(early.ckpt.files)  # registered once each, early; never again
    # the copies view the registered mappings themselves
    ranges = [(p, p + n) for p, n in expected.items()]
    assert all(any(a <= t.data_ptr() < b for a, b in ranges) for block in hw.copies for t, _ in block)
    hw.release()
    assert platform.live == {}


@pytest.mark.parametrize("how", ["refuse", "fail"])
def test_a_refused_or_failed_registration_falls_back_to_the_arena_and_leaves_nothing_registered(sharded, how):
    meta, layouts = _layouts(sharded)
    platform = RecordingPlatform(**{how: 2})  # the second file
    early = EarlyRegistration(cached_checkpoint(sharded), platform, torch.device("cpu"))
    assert not early.wait()
    assert ("refused" in early.problem) if how == "refuse" else ("driver error" in early.problem)
    hw = prepare_host_weights(early.ckpt, layouts, meta.target_dtype, 1, 0, platform, "auto", early)
    assert hw.source == "arena" and hw.reason == early.problem
    assert platform.live == {}  # the first file's registration was undone
    with pytest.raises(RuntimeError, match="not possible"):
        prepare_host_weights(early.ckpt, layouts, meta.target_dtype, 1, 0, platform, "registered",
                             EarlyRegistration(cached_checkpoint(sharded), RecordingPlatform(refuse=1),
                                               torch.device("cpu")))


def test_an_arena_choice_releases_every_early_registration(sharded):
    meta, layouts = _layouts(sharded)
    platform = RecordingPlatform()
    early = EarlyRegistration(cached_checkpoint(sharded), platform, torch.device("cpu"))
    hw = prepare_host_weights(early.ckpt, layouts, meta.target_dtype, 1, 0, platform, "arena", early)
    assert hw.source == "arena" and platform.live == {} and platform.calls == len(early.ckpt.files)
