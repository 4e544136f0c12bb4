"""dlo.engine.peergather on real gloo ranks: `DLO_GATHER=peer` rebuilds every block with the bytes
of the collective (bit-identical to resident), ranks that disagree on the path refuse to start, and
a rank that stops makes the others fail loudly within the deadline instead of hanging. (An idle rank
of a wave serving its shards: `test_offload.test_gather_only_on_one_rank_keeps_others_exact`.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dlo.engine.peergather import GATHER_ENV, gather_path
from tests.engine.dist_utils import run_ranks
from tests.engine.inputs import forward

CALLS = 4  # more calls than slots: the handshake's counters wrap over both slots several times


@pytest.mark.parametrize("raw, want", [(None, "collective"), ("", "collective"), (" peer ", "peer"),
                                       ("collective", "collective")])
def test_gather_path_reads_the_environment(raw, want):
    env = {} if raw is None else {GATHER_ENV: raw}
    assert gather_path(env) == want


@pytest.mark.parametrize("raw", ["nccl", "Peer", "copy-engine", "1"])
def test_gather_path_refuses_other_values_naming_them(raw):
    with pytest.raises(ValueError, match=f"DLO_GATHER must be one of collective, peer, got {raw!r}"):
        gather_path({GATHER_ENV: raw})


def _peer_equals_collective(rank: int, world: int, models: dict) -> dict:
    from dlo.engine import load

    out = {}
    for (family, kind), path in models.items():
        if kind == "sharded":  # the file layout is the loader's business, not the gathers'
            continue
        ref = load(path, mode="resident", device="cpu")
        dtype = torch.bfloat16 if kind == "bf16" else torch.float32
        refs = [forward(ref.module, family, s, dtype) for s in range(CALLS)]
        stats = {}
        for value in ("collective", "peer"):
            os.environ[GATHER_ENV] = value
            m = load(path, mode="allgather", device="cpu")
            same = [torch.equal(forward(m.module, family, s, dtype), refs[s]) for s in range(CALLS)]
            st = m.stats()
            stats[value] = (m.report.transfer, same, st.gathers, st.h2d_bytes, st.collective_bytes)
            m.close()
        os.environ.pop(GATHER_ENV)
        out[f"{family}-{kind}"] = stats
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_peer_gathers_are_bit_identical_to_resident_and_move_what_the_collective_moves(models, world):
    leftovers = set(Path("/dev/shm").glob("dlo-peer-*")) if Path("/dev/shm").is_dir() else set()
    results = run_ranks(world, _peer_equals_collective, models)
    for rank, res in enumerate(results):
        for key, stats in res.items():
            transfer, same, *moved = stats["peer"]
            assert transfer == "peer", (rank, key, transfer)
            assert all(same), f"rank {rank} {key}: peer-gathered outputs differ from resident on calls {same}"
            c_transfer, c_same, *c_moved = stats["collective"]
            assert c_transfer == "eager" and all(c_same), (rank, key, stats["collective"])
            assert moved == c_moved, f"rank {rank} {key}: peer {moved} vs collective {c_moved} (gathers, bytes)"
    if Path("/dev/shm").is_dir():  # the shared files are unlinked once every rank has mapped them
        assert set(Path("/dev/shm").glob("dlo-peer-*")) <= leftovers


def _disagree(rank: int, world: int, path: str) -> str:
    os.environ[GATHER_ENV] = "peer" if rank == 0 else "collective"
    from dlo.engine import load

    try:
        load(path, mode="allgather", device="cpu")
    except RuntimeError as e:
        return str(e)
    return "loaded"


def test_ranks_that_disagree_on_the_path_refuse_to_start(models):
    results = run_ranks(2, _disagree, models[("flux", "fp32")], timeout=120)
    for msg in results:
        assert "disagree on DLO_GATHER: ['peer', 'collective']" in msg, results


def _one_rank_stops(rank: int, world: int, path: str) -> str:
    import dlo.engine.peergather as pg
    from dlo.engine import load
    from dlo.engine.prefetch import PrefetchOrderError

    os.environ[GATHER_ENV] = "peer"
    pg.PEER_WAIT_S = 3.0
    m = load(path, mode="allgather", device="cpu")
    forward(m.module, "flux", 0, torch.float32)  # one call together
    if rank == 1:
        return "stopped"  # and never gathers again: as dead to its peers as a killed rank
    try:
        forward(m.module, "flux", 1, torch.float32)
    except pg.PeerGatherError as e:
        first = str(e)
    else:
        return "no error"
    try:
        forward(m.module, "flux", 2, torch.float32)
    except PrefetchOrderError as e:  # broken for good: the engine must restart
        return f"{first} | {e}"
    return f"{first} | no second error"


def test_a_rank_that_stops_fails_its_peers_loudly_within_the_deadline(models):
    results = run_ranks(2, _one_rank_stops, models[("flux", "fp32")], timeout=120)
    assert results[1] == "stopped"
    first, _, second = results[0].partition(" | ")
    assert "rank(s) [1] did not" in first and "in 3 s; restart the engine" in first, results[0]
    assert "restart the engine" in second, results[0]
