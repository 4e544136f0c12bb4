"""Host memory while loading: a rank holds its shard of each block and nothing more.

The bound per rank, private anonymous memory grown during `load` (sampled every 2 ms):
    shard bytes (its arena) + slot bytes + resident bytes (on CPU the "device" is host memory)
    + FRAMEWORK_SLACK (Python objects of the meta model, allocator arenas).
"""

from __future__ import annotations

import threading
import time

from pathlib import Path

import pytest

from dlo.agent.memory import parse_kb_table

from dlo.engine.families.tiny import make_tiny_transformer
from tests.engine.dist_utils import run_ranks

FRAMEWORK_SLACK = 48 * 1024 * 1024


def _status() -> dict[str, int]:
    return parse_kb_table(Path("/proc/self/status").read_text())


def _rss_anon() -> int:
    return _status()["RssAnon"]


def _vm_lck() -> int:
    return _status().get("VmLck", 0)


def _load_and_measure(rank: int, world: int, path: str) -> dict:
    import torch  # noqa: F401  (imports happen before the baseline)
    import diffusers  # noqa: F401

    from dlo.engine import OffloadSettings, load

    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_anon())
            time.sleep(0.002)

    base = _rss_anon()
    t = threading.Thread(target=sample, daemon=True)
    t.start()
    m = load(path, settings=OffloadSettings("allgather"), device="cpu")
    stop.set()
    t.join()
    peak[0] = max(peak[0], _rss_anon())
    r = m.report
    return dict(growth=peak[0] - base, pinned=r.host_pinned_bytes, slots=r.slot_bytes,
                resident=r.resident_bytes, vm_lck=_vm_lck(), g=r.shard_group_size)


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    # 6 Wan blocks at dim 1024 in float32: about 340 MB
    return make_tiny_transformer(tmp_path_factory.mktemp("big") / "t", "wan", layers=6, dim=1024)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_allgather_rank_holds_only_its_shards(big_model, world):
    from dlo.engine.checkpoint import Checkpoint
    from dlo.engine.blocks import block_layout, group_keys
    from dlo.engine.families import BLOCK_FAMILIES

    ck = Checkpoint(big_model)
    assert ck.nbytes >= 256 * 1024 * 1024
    blocks, _ = group_keys(set(ck.tensors), BLOCK_FAMILIES["wan"])
    shard_total = 0
    for b in blocks:
        shard_total += block_layout(ck, b).shard_bytes(world)
    results = run_ranks(world, _load_and_measure, str(big_model))
    for rank, res in enumerate(results):
        assert res["g"] == world
        assert res["pinned"] == shard_total, (rank, res["pinned"], shard_total)
        assert res["vm_lck"] >= shard_total  # mlock'ed: the kernel accounts it as locked
        bound = shard_total + res["slots"] + res["resident"] + FRAMEWORK_SLACK
        assert res["growth"] <= bound, (rank, res, bound)
        # and far below one full copy of the model per rank
        assert res["growth"] < ck.nbytes
