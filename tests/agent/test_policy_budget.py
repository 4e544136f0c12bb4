"""dlo.plan.policy with the device budget (issue 27): a cap or a stated budget is a smaller device,
the whole pipeline's weights and the largest accepted request count, and nothing fitting names the
smallest budget that would."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlo.plan.policy import NoModeFits, choose_mode
from dlo.plan.profile import Accelerator, NodeProfile
from dlo.plan.facts import ModelFacts
from dlo.plan.memory_model import Geometry, PipelineMemory, RequestBounds
from dlo.plan.memory_table import MemoryTable
from tests.agent.test_policy import GB, node


GIB = 2**30
H200 = NodeProfile(
    node="h200", accelerator=Accelerator(vendor="nvidia", model="NVIDIA H200", count=1, memory_bytes=150_754_820_096),
    h2d_bandwidth_bps=55_300_000_000, host_memory_bytes=2000 * GB, can_register_page_cache=True,
)
WAN = ModelFacts(bytes=28_640_000_000, largest_block_bytes=703_000_000, blocks=40, nonblock_bytes=500_000_000,
                 family="wan")


def _wan_pipeline(table: str | None = None, **bounds: int) -> PipelineMemory:
    umt5 = ModelFacts(bytes=11_360_000_000, largest_block_bytes=400_000_000, blocks=24, nonblock_bytes=2_100_000_000)
    t = MemoryTable.load(Path(__file__).parents[1] / "engine" / "fixtures" / table) if table else MemoryTable()
    return PipelineMemory("wan", Geometry(16, 4), {"transformer": WAN}, {"text_encoder": umt5}, {"vae": 508_000_000},
                          RequestBounds(**{"max_width": 832, "max_height": 480, "max_frames": 17, **bounds}),
                          1280 * 720 * 81, t)


def test_a_24gib_cap_is_a_smaller_device_the_policy_never_fills_resident() -> None:
    # defect 1: `--max-device-memory 24GiB` on an H200 placed the whole 28.6 GB transformer
    assert choose_mode(H200, WAN, dp=1).mode == "resident"
    capped = choose_mode(H200, WAN, dp=1, device_budget_bytes=24 * GIB)
    assert capped.mode == "rank_local" and not capped.estimates["resident"].fits
    assert capped.device_budget_bytes == 24 * GIB
    stated = H200.model_copy(update={"accelerator": H200.accelerator.model_copy(update={"budget_bytes": 24 * GIB})})
    assert choose_mode(stated, WAN, dp=1).mode == "rank_local"  # a node profile may state the budget
    assert choose_mode(stated, WAN, dp=1, device_budget_bytes=100 * GIB).device_budget_bytes == 24 * GIB


def test_the_whole_pipeline_counts_against_the_budget() -> None:
    # 28.6 GB of transformer fit 85% of a 40 GB budget; with UMT5 and the VAE (40.5 GB) they do not
    assert choose_mode(H200, WAN, dp=1, device_budget_bytes=40 * GB).mode == "resident"
    d = choose_mode(H200, WAN, dp=1, device_budget_bytes=40 * GB, pipeline=_wan_pipeline())
    assert d.mode == "rank_local" and d.estimates["resident"].device_weight_bytes == 40_508_000_000
    assert d.estimates["rank_local"].device_peak_bytes is None  # the committed table has no wan rows yet


@settings(max_examples=150, deadline=None)
@given(model_gb=st.integers(1, 200), block_frac=st.floats(0.001, 0.2), dp=st.integers(1, 8),
       budget_frac=st.floats(0.01, 0.999), measured=st.booleans())
def test_a_budget_below_the_weights_never_chooses_resident(
    model_gb: int, block_frac: float, dp: int, budget_frac: float, measured: bool
) -> None:
    model = ModelFacts(bytes=model_gb * GB, largest_block_bytes=max(1, int(model_gb * GB * block_frac)), blocks=10)
    pipeline = _wan_pipeline("memory_table_small.json") if measured else None
    weights = 40_508_000_000 if measured else model.bytes
    if measured:
        model = WAN
    budget = int(weights * budget_frac)
    try:
        d = choose_mode(node(device_memory=2000 * GB, count=dp), model, dp=dp, block_compute_seconds=0.01,
                        device_budget_bytes=budget, pipeline=pipeline)
    except NoModeFits:
        return
    assert d.mode != "resident"
    chosen = d.estimates[d.mode]
    assert (chosen.device_peak_bytes if measured else chosen.device_weight_bytes) <= budget


def test_a_measured_peak_decides_the_fit_and_nothing_fitting_names_the_smallest_budget() -> None:
    pipeline = _wan_pipeline("memory_table_small.json", max_width=1920, max_height=1920, max_frames=129)
    rank = pipeline.rank("rank-local")
    assert rank.peak_bytes is not None and rank.peak_bytes > rank.weights_bytes / 0.85
    budget = int(rank.weights_bytes / 0.85) + GB  # the old reserve rule would fit; the largest request does not
    with pytest.raises(NoModeFits) as err:
        choose_mode(H200, WAN, dp=1, device_budget_bytes=budget, pipeline=pipeline)
    text = str(err.value)
    need = f"{rank.peak_bytes / 1e9:.1f} GB"
    assert f"the smallest device budget that fits is {need} (rank-local)" in text and "--max-size" in text
    assert "1920x1920x129" in text  # what does not fit: the largest accepted request's worst phase
    assert choose_mode(H200, WAN, dp=1, device_budget_bytes=rank.peak_bytes, pipeline=pipeline).mode == "rank_local"
    with pytest.raises(NoModeFits, match=r"smallest device budget that fits is 2\.2 GB \(rank-local\)"):
        choose_mode(H200, WAN, dp=1, device_budget_bytes=GB)  # unmeasured: the weights over the 85% rule
