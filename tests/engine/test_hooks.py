"""dlo.engine.hooks: DLO attaches through removable forward hooks, and a profiler sees the schedule."""

from __future__ import annotations

import torch

from dlo.engine.families.tiny import make_tiny_transformer
from tests.engine.inputs import forward


def _hook_counts(module: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in module.modules())


def test_close_leaves_the_module_with_no_dlo_hooks_and_its_own_forward(tmp_path):
    from dlo.engine import OffloadSettings, load

    path = make_tiny_transformer(tmp_path / "wan", "wan", layers=3)
    m = load(path, settings=OffloadSettings("rank-local"), device="cpu")
    blocks = list(m.module.blocks)
    assert all("forward" not in vars(b) for b in blocks)  # forward is never replaced
    assert all(len(b._forward_pre_hooks) == 1 and len(b._forward_hooks) == 1 for b in blocks)
    assert len(m.hooks) == 2 * len(blocks)
    forward(m.module, "wan", 0, torch.float32)
    m.close()
    assert len(m.hooks) == 0
    assert _hook_counts(m.module) == 0


def test_resident_model_has_no_hooks(tmp_path):
    from dlo.engine import OffloadSettings, load

    m = load(make_tiny_transformer(tmp_path / "wan", "wan", layers=2), settings=OffloadSettings("resident"), device="cpu")
    assert _hook_counts(m.module) == 0
    m.close()


def test_a_cpu_profiler_trace_shows_gather_bind_and_block_ranges(tmp_path):
    from torch.profiler import ProfilerActivity, profile

    from dlo.engine import OffloadSettings, load

    m = load(make_tiny_transformer(tmp_path / "wan", "wan", layers=3), settings=OffloadSettings("rank-local"), device="cpu")
    forward(m.module, "wan", 0, torch.float32)  # warm: ranges appear whatever the call
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward(m.module, "wan", 1, torch.float32)
    names = [e.name for e in prof.events()]
    assert names.count("dlo::block") == 3
    assert names.count("dlo::gather") == 3  # each block prefetches the next (the last one block 0)
    assert "dlo::bind" in names
    m.close()


def test_ranges_cost_nothing_without_a_profiler(tmp_path):
    from dlo.engine import OffloadSettings, load
    from dlo.engine.prefetch import profiling

    assert not profiling()
    m = load(make_tiny_transformer(tmp_path / "wan", "wan", layers=2), settings=OffloadSettings("rank-local"), device="cpu")
    forward(m.module, "wan", 0, torch.float32)
    assert m.stats().gathers == 3  # block 0 at load, then one prefetch per block
    m.close()
