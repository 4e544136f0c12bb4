"""dlo.engine.transfers: the transfer is one object chosen once from the settings, and the slot
prefetcher moves every gather through whichever transfer it was given (slot n % 2 for gather n,
block 0 eagerly at load, then the started transfer), with outputs equal to resident."""

from __future__ import annotations

import logging

import pytest
import torch

from dlo.engine.settings import OffloadSettings
from dlo.engine.transfers import BlockTransfer, EagerTransfer, GraphTransfer, Lanes, SlotPlan, choose_transfer
from tests.engine.inputs import forward


class RecordingTransfer(EagerTransfer):
    """The real eager transfer, noting what the prefetcher asks of it and when."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def attach(self, lanes: Lanes, plan: SlotPlan) -> list[torch.Tensor]:
        self.calls.append(("attach", len(plan.shards), plan.g, plan.r))
        return super().attach(lanes, plan)

    def start(self) -> BlockTransfer:
        self.calls.append(("start",))
        return super().start()

    def issue(self, i: int, k: int, n: int) -> None:
        self.calls.append((i, k, n))
        super().issue(i, k, n)


def test_the_prefetcher_moves_every_gather_through_the_transfer_it_was_given(models):
    from dlo.engine import load
    from dlo.engine.prefetch import SlotPrefetcher

    path = models[("wan", "bf16")]  # 3 blocks: a block alternates slots between calls
    ref = forward(load(path, settings=OffloadSettings("resident"), device="cpu").module, "wan", 0, torch.bfloat16)
    m = load(path, settings=OffloadSettings("rank-local"), device="cpu")
    src = m.prefetcher
    m.hooks.remove()  # the load's own prefetcher steps aside (no block ran through it)
    from dlo.engine.hooks import attach_prefetcher

    rec = RecordingTransfer()
    pipe = SlotPrefetcher(m.module, src.blocks, src.copies, transfer=rec, settings=OffloadSettings("rank-local"),
                          platform=src.platform, device=src.slots[0].device, g=1, r=0)
    attach_prefetcher(pipe, m.hooks)
    assert rec.calls == [("attach", 3, 1, 0), (0, 0, 0), ("start",)]  # block 0 eagerly, then started
    outs = [forward(m.module, "wan", 0, torch.bfloat16) for _ in range(2)]
    assert all(torch.equal(o, ref) for o in outs)
    # gather n is block n % 3 into slot n % 2, in order, each through the one transfer
    assert rec.calls[3:] == [(n % 3, n % 2, n) for n in range(1, 7)]
    assert pipe.transfer is rec and pipe.stats.gathers == 7
    assert pipe.stats.h2d_bytes == sum(src.blocks[n % 3].shard for n in range(7)) and pipe.stats.collective_bytes == 0


def test_the_transfer_is_chosen_from_the_settings():
    from dlo.engine.platform import get_platform

    cpu = get_platform(torch.device("cpu"))
    eager = choose_transfer(OffloadSettings("rank-local"), cpu, None, 1)  # transfer graphs: None, on cuda only
    assert type(eager) is EagerTransfer and eager.name == "eager" and not eager.receives
    graphs = choose_transfer(OffloadSettings("rank-local", transfer_graphs=True), cpu, None, 1)
    assert isinstance(graphs, GraphTransfer) and graphs.name == "graph" and type(graphs.eager) is EagerTransfer
    with pytest.raises(ValueError, match="peer gathers need allgather over more than one rank"):
        choose_transfer(OffloadSettings("rank-local", transfer="peer"), cpu, None, 1)


def test_transfer_graphs_where_capture_fails_fall_back_to_eager_and_say_so(models, caplog):
    """The graph transfer's capture path runs up to the capture, which a CPU build cannot do: the
    model then streams eagerly (reported) with the same bytes."""
    from dlo.engine import load

    path = models[("flux", "fp32")]
    ref = forward(load(path, settings=OffloadSettings("resident"), device="cpu").module, "flux", 2, torch.float32)
    with caplog.at_level(logging.WARNING, logger="dlo.engine.transfers"):
        m = load(path, settings=OffloadSettings("rank-local", transfer_graphs=True), device="cpu")
    assert "transfer graphs unavailable" in caplog.text and "using eager transfers" in caplog.text
    assert m.report.transfer == "eager" and type(m.prefetcher.transfer) is EagerTransfer
    assert all(torch.equal(forward(m.module, "flux", 2, torch.float32), ref) for _ in range(2))
    m.close()
