"""dlo.engine.peergather on real gloo ranks: `transfer="peer"` (`--gather peer`) rebuilds every block with the bytes
of the collective (bit-identical to resident), ranks that disagree on the path refuse to start, and
a rank that stops makes the others fail loudly within the deadline instead of hanging. (An idle rank
of a wave serving its shards: `test_offload.test_gather_only_on_one_rank_keeps_others_exact`.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.dist_utils import run_ranks
from tests.engine.inputs import forward

CALLS = 4  # more calls than slots: the handshake's counters wrap over both slots several times


def _peer_equals_collective(rank: int, world: int, models: dict) -> dict:
    from dlo.engine import OffloadSettings, load

    out = {}
    for (family, kind), path in models.items():
        if kind == "sharded":  # the file layout is the loader's business, not the gathers'
            continue
        ref = load(path, settings=OffloadSettings("resident"), device="cpu")
        dtype = torch.bfloat16 if kind == "bf16" else torch.float32
        refs = [forward(ref.module, family, s, dtype) for s in range(CALLS)]
        stats = {}
        for value in ("collective", "peer"):
            m = load(path, settings=OffloadSettings("allgather", transfer=value), device="cpu")
            same = [torch.equal(forward(m.module, family, s, dtype), refs[s]) for s in range(CALLS)]
            st = m.stats()
            stats[value] = (m.report.transfer, same, st.gathers, st.h2d_bytes, st.collective_bytes)
            m.close()
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


def _load_refused(path: str, transfer: str = "peer") -> str:
    """Why an allgather load refused to start on this rank ("loaded" when it did not refuse)."""
    from dlo.engine import OffloadSettings, load

    try:
        load(path, settings=OffloadSettings("allgather", transfer=transfer), device="cpu")
    except RuntimeError as e:
        return str(e)
    return "loaded"


def _disagree(rank: int, world: int, path: str) -> str:
    return _load_refused(path, "peer" if rank == 0 else "collective")


def test_ranks_that_disagree_on_the_path_refuse_to_start(models):
    results = run_ranks(2, _disagree, models[("flux", "fp32")], timeout=120)
    for msg in results:
        assert "disagree on the transfer (--gather, DLO_GATHER): ['peer', 'collective']" in msg, results


def _one_rank_cannot_make_its_slots(rank: int, world: int, path: str) -> str:
    from dlo.engine.peergather import PeerGather

    if rank == 1:
        def no_space(self, *args):
            raise OSError(28, "No space left on device")

        PeerGather._make_own = no_space
    return _load_refused(path)


def test_a_setup_step_that_fails_on_one_rank_fails_every_rank_alike(models):
    """Not one rank raising while the others wait in the next collective: the same error everywhere."""
    results = run_ranks(3, _one_rank_cannot_make_its_slots, models[("flux", "fp32")], timeout=120)
    assert len(set(results)) == 1, results
    assert ("DLO_GATHER=peer cannot start: rank 1 making its slots: OSError: [Errno 28] No space left on device; "
            "unset DLO_GATHER") in results[0], results


def test_files_the_ranks_do_not_share_are_refused_not_created(tmp_path):
    from dlo.engine.peergather import PeerGatherError, _map_existing

    missing = tmp_path / "dlo-peer-x-counters"
    with pytest.raises(PeerGatherError, match="is missing here: the ranks do not share"):
        _map_existing(missing, 8, torch.int64)
    assert not missing.exists()  # torch.from_file(shared=True) would have made an empty one
    short = tmp_path / "dlo-peer-x-r1-s0"
    short.write_bytes(b"\0" * 10)
    with pytest.raises(PeerGatherError, match="holds 10 bytes, not 64"):
        _map_existing(short, 64, torch.uint8)
    full = tmp_path / "dlo-peer-x-r1-s1"
    full.write_bytes(bytes(range(64)))
    assert torch.equal(_map_existing(full, 64, torch.uint8), torch.arange(64, dtype=torch.uint8))


def _one_rank_stops(rank: int, world: int, path: str) -> str:
    import dlo.engine.peergather as pg
    from dlo.engine import OffloadSettings, load
    from dlo.engine.prefetch import PrefetchOrderError

    import torch.distributed as dist

    m = load(path, settings=OffloadSettings("allgather", transfer="peer"), device="cpu")
    forward(m.module, "flux", 0, torch.float32)  # one call together
    dist.barrier()
    m.prefetcher.transfer.peer.wait_s = 3.0  # from here on (the load and the first call ran under the group's timeout)
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
