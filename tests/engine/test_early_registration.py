"""Registering the page cache early (`EarlyRegistration`): what the host weights adopt, what is
released, and the fallbacks. The platform here records the driver calls (CPU has no DMA
registration); the CUDA path is measured on the GPU (the records `ready-h200-*`)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from dlo.engine.checkpoint import cached_checkpoint
from dlo.engine.blocks import block_layout
from dlo.engine.families.tiny import make_tiny_transformer
from dlo.engine.model import build_meta_model
from dlo.engine.platform import Platform
from dlo.engine.weights import EarlyRegistration, prepare_host_weights
from tests.engine.serving_helpers import wait_until


class RecordingPlatform(Platform):
    """The CPU platform, plus a driver that registers host ranges: it records every call, refuses the
    calls numbered in `refuse` and every call from `refuse_from` on, and raises on call `fail`."""

    has_streams = True
    registers_host_memory = True

    def __init__(self, refuse: set[int] = frozenset(), refuse_from: int | None = None, fail: int | None = None):
        self.refuse, self.refuse_from, self.fail = set(refuse), refuse_from, fail
        self.live: dict[int, int] = {}  # ptr -> bytes currently registered
        self.calls = 0

    def register_read_only(self, ptr: int, nbytes: int) -> bool:
        self.calls += 1
        if self.calls == self.fail:
            raise RuntimeError("driver error")
        if self.calls in self.refuse or (self.refuse_from is not None and self.calls >= self.refuse_from):
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


def _used(early: EarlyRegistration, meta) -> dict[int, int]:
    paths = {early.ckpt.tensors[k].path for b in meta.blocks for k in b.keys}
    return {early.ckpt.file_bytes(p).data_ptr(): early.ckpt.file_bytes(p).numel() for p in paths}


@pytest.mark.parametrize("platform_kw", [{"refuse": {2}}, {"fail": 2}])
def test_a_failed_early_registration_registers_the_used_files_again(sharded, platform_kw):
    """A refusal or a driver error during the early pass (maybe on a file this rank does not use)
    costs the early start, never the registered source: the used files are registered in order."""
    meta, layouts = _layouts(sharded)
    platform = RecordingPlatform(**platform_kw)
    early = EarlyRegistration(cached_checkpoint(sharded), platform, torch.device("cpu"))
    assert not early.wait()
    assert ("refused" in early.problem) if "refuse" in platform_kw else ("driver error" in early.problem)
    hw = prepare_host_weights(early.ckpt, layouts, meta.target_dtype, 1, 0, platform, "auto", early)
    assert hw.source == "registered" and platform.live == _used(early, meta)
    hw.release()
    assert platform.live == {}


def test_a_platform_that_keeps_refusing_falls_back_to_the_arena_and_leaves_nothing_registered(sharded):
    meta, layouts = _layouts(sharded)
    platform = RecordingPlatform(refuse_from=2)  # the first file registers early, nothing after
    early = EarlyRegistration(cached_checkpoint(sharded), platform, torch.device("cpu"))
    hw = prepare_host_weights(early.ckpt, layouts, meta.target_dtype, 1, 0, platform, "auto", early)
    assert hw.source == "arena" and hw.reason == "the platform refused to register the file mappings"
    assert platform.live == {}
    platform = RecordingPlatform(refuse_from=2)
    early = EarlyRegistration(cached_checkpoint(sharded), platform, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="not possible"):
        prepare_host_weights(early.ckpt, layouts, meta.target_dtype, 1, 0, platform, "registered", early)
    assert platform.live == {}


def test_an_arena_choice_releases_every_early_registration(sharded):
    meta, layouts = _layouts(sharded)
    platform = RecordingPlatform()
    early = EarlyRegistration(cached_checkpoint(sharded), platform, torch.device("cpu"))
    hw = prepare_host_weights(early.ckpt, layouts, meta.target_dtype, 1, 0, platform, "arena", early)
    assert hw.source == "arena" and platform.live == {} and platform.calls == len(early.ckpt.files)


@pytest.mark.parametrize("mode", ["resident", "rank-local"])
def test_load_releases_what_it_does_not_keep_on_every_path(sharded, mode):
    """`dlo.engine.load(early=...)`: resident keeps nothing registered, a rank-local load on cpu takes
    the arena. (A bad argument never reaches `load`: `OffloadSettings` refuses it, test_settings.)"""
    from dlo.engine import OffloadSettings, load

    platform = RecordingPlatform()
    early = EarlyRegistration(cached_checkpoint(sharded), platform, torch.device("cpu"))
    m = load(sharded, settings=OffloadSettings(mode), device="cpu", early=early)
    assert m.report.weights_source == ("resident" if mode == "resident" else "arena")
    m.close()
    assert platform.live == {} and platform.calls == len(early.ckpt.files)


def test_early_registration_starts_in_every_mode_unless_the_arena_or_the_setting_says_no(sharded, monkeypatch):
    import dlo.engine.offload as offload
    from dlo.engine import OffloadSettings

    assert offload.early_registration(sharded, "cpu", OffloadSettings("rank-local")) is None  # cpu registers nothing
    platform = RecordingPlatform()
    monkeypatch.setattr(offload, "get_platform", lambda device: platform)
    resident = offload.early_registration(sharded, "cpu", OffloadSettings("resident"))  # its copies read them
    assert isinstance(resident, EarlyRegistration) and resident.wait()
    resident.release()
    assert offload.early_registration(sharded, "cpu", OffloadSettings("allgather", weights="arena")) is None
    assert offload.early_registration(sharded, "cpu", OffloadSettings("allgather", register_early=False)) is None
    early = offload.early_registration(sharded, "cpu", OffloadSettings("allgather"))
    assert isinstance(early, EarlyRegistration) and early.wait()
    early.release()
    assert platform.live == {} and platform.calls == 2 * len(early.ckpt.files)


class StreamPlatform(RecordingPlatform):
    """`RecordingPlatform` with stream and event handles (the work itself still runs in program
    order on cpu) that records the host's waits, and refuses an unregistration that comes before
    the host waited for the resident copies' event."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.events: list[str] = []
        self.waited: list[str] = []
        self.issuers: set[str] = set()  # the threads that issued copies on the copy stream

    def new_stream(self, role):
        return f"stream:{role}"

    def current_stream(self):
        return "stream:compute"

    def new_event(self, timing=False):
        self.events.append(f"event{len(self.events)}")
        return self.events[-1]

    def host_wait(self, event):
        self.waited.append(event)

    def synchronize(self):  # waits for everything, the copies' event included
        self.waited.append("synchronize")

    def set_stream(self, stream):
        if stream == "stream:resident":
            self.issuers.add(threading.current_thread().name)

    def unregister(self, ptr):
        assert self.waited, "a file unregistered while the resident copies may still read it"
        super().unregister(ptr)


@pytest.mark.parametrize("settle", [True, False])
def test_resident_copies_read_the_registered_files_until_they_settle(sharded, monkeypatch, settle):
    """[Note: resident copies]: a resident load copies from the registered files (asynchronously
    where the platform has streams) and the files stay registered until the host has waited for the
    copies' event: at the end of `load`, or after `settle()` with `settle=False`, where the copies
    are issued on a thread of their own while the caller goes on, and the registrations are
    released on another once they have landed. The weights are exactly those of a load without
    registration."""
    import dlo.engine.offload as offload
    from dlo.engine import OffloadSettings, load

    ref = load(sharded, settings=OffloadSettings("resident"), device="cpu").module.state_dict()
    platform = StreamPlatform()
    monkeypatch.setattr(offload, "get_platform", lambda device: platform)
    settings = OffloadSettings("resident")
    m = load(sharded, settings=settings, device="cpu", early=offload.early_registration(sharded, "cpu", settings),
             settle=settle)
    if not settle:
        assert platform.waited == [] and len(platform.live) == len(cached_checkpoint(sharded).files)
        assert m.settle() >= 0.0
        wait_until(lambda: platform.live == {}, 10, "the registrations released after the copies")
    assert platform.issuers == ({"MainThread"} if settle else {"dlo-resident-copies"})
    got = m.module.state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
    done = platform.events[-1]  # recorded on the copy stream after the last copy
    waits = len(platform.waited)
    assert waits and set(platform.waited) == {done} and platform.live == {}
    m.settle()  # idempotent
    m.close()
    assert len(platform.waited) == waits and platform.live == {}


def test_a_streaming_load_unregisters_the_files_it_does_not_keep_only_after_the_resident_copies(sharded, monkeypatch):
    """rank-local with a resident block: the host weights adopt the files of the streamed blocks and
    the rest is unregistered inside `load`, while the resident copies may still read it: only after
    the host has waited for their event (`EarlyRegistration.hold_until`; `StreamPlatform.unregister`
    refuses otherwise). The forward is that of a load without registration."""
    import dlo.engine.offload as offload
    from dlo.engine import OffloadSettings, load
    from tests.engine.inputs import forward

    settings = OffloadSettings("rank-local", resident_blocks=1)
    ref = load(sharded, settings=settings, device="cpu")
    platform = StreamPlatform()
    monkeypatch.setattr(offload, "get_platform", lambda device: platform)
    m = load(sharded, settings=settings, device="cpu", early=offload.early_registration(sharded, "cpu", settings),
             settle=False)
    assert m.report.weights_source == "registered" and m.report.resident_blocks == 1
    assert 0 < len(platform.live) < len(cached_checkpoint(sharded).files)  # some files were not kept
    start, done = platform.events[:2]  # placement: the copy stream's start, then the copies' end
    assert platform.waited[0] == done
    assert torch.equal(forward(m.module, "wan", 0, torch.float32), forward(ref.module, "wan", 0, torch.float32))
    m.close()
    ref.close()
    assert platform.live == {}


class Front:
    """A cold start's readahead as the registration sees it (`ReadFront`): a gate per file that says
    it was read; `asked` lists the files waited for, in order."""

    def __init__(self):
        self.gates: dict[Path, threading.Event] = {}
        self.asked: list[Path] = []

    def gate(self, path: Path) -> threading.Event:
        return self.gates.setdefault(path, threading.Event())

    def until_resident(self, path: Path, stop) -> float:
        self.asked.append(path)
        while not self.gate(path).wait(0.01) and not stop.is_set():
            pass
        return 0.0


def test_a_cold_file_is_registered_only_once_the_readahead_has_read_it(sharded):
    """[Note: pin what is read]: pinning a cold file reads it under the process's memory map, so the
    registration pins each file only after the readahead says it is in the page cache, in order."""
    platform = RecordingPlatform()
    front = Front()
    early = EarlyRegistration(cached_checkpoint(sharded), platform, torch.device("cpu"), after=front)
    files = early.ckpt.files
    for i, path in enumerate(files):
        wait_until(lambda: len(front.asked) == i + 1, 10, f"the registration asks for file {i}")
        assert front.asked[i] == path and len(early.registered) == i  # nothing pinned ahead of the read
        front.gate(path).set()
        wait_until(lambda: path in early.registered, 10, f"file {i} registered once read")
    assert early.wait() and len(platform.live) == len(files)
    early.release()


def test_releasing_a_registration_that_still_waits_stops_it_at_once(sharded):
    """A load that fails while the registration waits for the readahead: `release()` neither waits
    for the readahead's read nor pins files only to unpin them."""
    import time

    platform = RecordingPlatform()
    early = EarlyRegistration(cached_checkpoint(sharded), platform, torch.device("cpu"), after=Front())
    t0 = time.perf_counter()
    early.release()
    assert time.perf_counter() - t0 < 5 and platform.calls == 0 and platform.live == {}
    assert not early.wait() and "released" in early.problem

    platform = RecordingPlatform()  # waiting for a file the readahead has not read yet
    front = Front()
    early = EarlyRegistration(cached_checkpoint(sharded), platform, torch.device("cpu"), after=front)
    wait_until(lambda: front.asked, 10, "the registration waits for its first file")
    t0 = time.perf_counter()
    early.release()
    assert time.perf_counter() - t0 < 5 and platform.calls == 0 and platform.live == {}
    assert not early.wait() and "released" in early.problem


def test_a_copy_that_fails_on_the_copies_thread_fails_the_settle_and_leaves_nothing_registered(sharded, monkeypatch):
    """The blast radius of a resident copy that fails on its own thread (`settle=False`, nothing
    streamed): the error comes out of `settle()` on the caller's thread, after a synchronise, and
    `close()` leaves no file registered."""
    import dlo.engine.offload as offload
    import dlo.engine.placement as placement
    from dlo.engine import OffloadSettings, load

    platform = StreamPlatform()
    monkeypatch.setattr(offload, "get_platform", lambda device: platform)

    def failing(*args, **kwargs):
        raise RuntimeError("copy failed on the device")

    monkeypatch.setattr(placement, "_copy_in_file_order", failing)
    settings = OffloadSettings("resident")
    m = load(sharded, settings=settings, device="cpu", early=offload.early_registration(sharded, "cpu", settings),
             settle=False)
    with pytest.raises(RuntimeError, match="copy failed on the device"):
        m.settle()
    assert platform.waited == ["synchronize"]  # before the error came out: nothing in flight
    m.close()
    assert platform.live == {}
