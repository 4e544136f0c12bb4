"""dlo.plan.policy: the issue's decision vectors, the memory model and the time formulas."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlo.plan.policy import (
    FRAMEWORK_BASE_BYTES,
    FRAMEWORK_MODEL_RATIO,
    Decision,
    PolicyError,
    choose_mode,
    estimate_modes,
    framework_bytes,
    padded_shard_bytes,
)
from dlo.plan.profile import Accelerator, Interconnect, NodeProfile
from dlo.plan.facts import ModelFacts

GB = 1_000_000_000
MODEL_60 = ModelFacts(bytes=60 * GB, largest_block_bytes=1_200_000_000, blocks=50)


def node(
    *,
    ram: int = 2000 * GB,
    coll: int = 400 * GB,
    kind: str = "nvlink",
    h2d: int = 55 * GB,
    device_memory: int = 48 * GB,
    register: bool = False,
    vendor: str = "nvidia",
    count: int = 8,
) -> NodeProfile:
    # The issue's vectors leave device memory open; 48 GB per device keeps a 60 GB model from
    # fitting resident, which the allgather/rank-local vectors require.
    return NodeProfile(
        node="n",
        accelerator=Accelerator(vendor=vendor, model="test", count=count, memory_bytes=device_memory),
        interconnect=Interconnect(kind=kind, collective_bandwidth_bps=coll),
        h2d_bandwidth_bps=h2d,
        host_memory_bytes=ram,
        can_register_page_cache=register,
    )


@pytest.mark.parametrize(
    "compute_ms, profile, expected",
    [
        (3, node(), "allgather"),
        (12, node(), "allgather"),
        (25, node(), "rank_local"),
        (25, node(ram=256 * GB), "allgather"),
        (5, node(kind="pcie", coll=20 * GB), "rank_local"),
    ],
    ids=["3ms", "12ms", "25ms-near-tie", "25ms-256GB-RAM", "pcie-5ms"],
)
def test_issue_vectors_8_gpus_60gb_model(compute_ms: float, profile: NodeProfile, expected: str) -> None:
    d = choose_mode(profile, MODEL_60, dp=8, block_compute_seconds=compute_ms / 1e3)
    assert d.mode == expected, d.reason


def test_20gb_model_on_141gb_device_is_resident() -> None:
    model = ModelFacts(bytes=20 * GB, largest_block_bytes=500_000_000, blocks=40)
    d = choose_mode(node(device_memory=141 * GB), model, dp=8, block_compute_seconds=0.003)
    assert d.mode == "resident"
    assert d.engine_mode == "resident"
    assert "fits one device" in d.reason


def test_rank_local_infeasible_with_256gb_names_the_pinned_need() -> None:
    d = choose_mode(node(ram=256 * GB), MODEL_60, dp=8, block_compute_seconds=0.025)
    est = d.estimates["rank_local"]
    assert est.pinned_host_bytes == 8 * 60 * GB
    assert not est.fits
    assert d.estimates["allgather"].fits
    assert "rank_local does not fit" in d.reason and "480.0 GB pinned" in d.reason


def test_block_time_formulas() -> None:
    est = estimate_modes(node(), MODEL_60, dp=8, block_compute_seconds=0.001)
    s, g = 1.2e9, 8
    assert est["rank_local"].block_seconds == pytest.approx(s / 55e9)
    assert est["allgather"].block_seconds == pytest.approx(max(s / (g * 55e9), s * (g - 1) / (g * 400e9)))
    assert est["resident"].block_seconds == pytest.approx(0.001)


def test_near_tie_within_5_percent_goes_rank_local_and_beyond_goes_allgather() -> None:
    # rank-local is H2D-bound at S/B = 21.8 ms; allgather compute-bound at t_c.
    rl = 1.2e9 / 55e9
    assert choose_mode(node(), MODEL_60, dp=8, block_compute_seconds=rl / 1.04).mode == "rank_local"
    assert choose_mode(node(), MODEL_60, dp=8, block_compute_seconds=rl / 1.06).mode == "allgather"


def test_registering_the_page_cache_makes_rank_local_hold_one_copy() -> None:
    est = estimate_modes(node(register=True, ram=256 * GB), MODEL_60, dp=8, block_compute_seconds=0.025)
    assert est["rank_local"].pinned_host_bytes == 60 * GB
    assert est["rank_local"].fits
    # the pinned bytes ARE the page cache: the cgroup sees one copy plus the framework
    assert est["rank_local"].cold_start_peak_bytes == 60 * GB + 8 * framework_bytes(60 * GB)


def test_ascend_pinned_memory_is_not_in_the_cold_start_peak() -> None:
    nv = estimate_modes(node(), MODEL_60, dp=8)
    asc = estimate_modes(node(vendor="ascend"), MODEL_60, dp=8)
    assert nv["allgather"].cold_start_peak_bytes - asc["allgather"].cold_start_peak_bytes == 60 * GB
    assert asc["allgather"].cold_start_peak_bytes == 60 * GB + 8 * framework_bytes(60 * GB)


@pytest.mark.parametrize(
    "model_gb, dp, measured_gb, tolerance",
    [(33, 4, 47, 0.01), (124, 2, 157, 0.05), (124, 4, 172, 0.03)],
    ids=["nano-dp4", "super-dp2", "super-dp4"],
)
def test_cold_start_peak_matches_published_ascend_measurements(
    model_gb: int, dp: int, measured_gb: int, tolerance: float
) -> None:
    model = ModelFacts(bytes=model_gb * GB, largest_block_bytes=model_gb * GB // 100, blocks=100)
    est = estimate_modes(node(vendor="ascend"), model, dp=dp)
    assert est["allgather"].cold_start_peak_bytes == pytest.approx(measured_gb * GB, rel=tolerance)


def test_device_weight_bytes_per_mode() -> None:
    facts = ModelFacts(family="wan", bytes=60 * GB, blocks=50, largest_block_bytes=1_200_000_000, nonblock_bytes=GB)
    est = estimate_modes(node(), facts, dp=8)
    assert est["resident"].device_weight_bytes == 60 * GB
    assert est["rank_local"].device_weight_bytes == 2 * 1_200_000_000 + GB
    assert est["allgather"].device_weight_bytes == 2 * 8 * padded_shard_bytes(1_200_000_000, 8) + GB


def test_padded_shard_is_ceil_then_256_aligned() -> None:
    assert padded_shard_bytes(1000, 3) == 512
    assert padded_shard_bytes(768, 3) == 256
    assert padded_shard_bytes(1, 8) == 256


def test_tokens_estimate_matches_wan_block_on_h200() -> None:
    wan_block = ModelFacts(bytes=28_600_000_000, largest_block_bytes=703_000_000, blocks=40)
    h200 = NodeProfile(
        accelerator=Accelerator(vendor="nvidia", model="NVIDIA H200", count=1, memory_bytes=141 * GB),
        h2d_bandwidth_bps=55_300_000_000,
        host_memory_bytes=2000 * GB,
    )
    # measured 4.6 ms at 4,096 tokens and 71 ms at 32,760 tokens (SEED-FACTS.md)
    assert estimate_modes(h200, wan_block, dp=1, tokens_per_rank=4096)["resident"].block_seconds == pytest.approx(
        4.6e-3, rel=0.1
    )
    assert estimate_modes(h200, wan_block, dp=1, tokens_per_rank=32760)["resident"].block_seconds == pytest.approx(
        71e-3, rel=0.15
    )


def test_no_workload_compares_weight_movement_and_says_so() -> None:
    d = choose_mode(node(), MODEL_60, dp=8)
    assert d.mode == "allgather"
    assert "no workload given" in d.reason


def test_no_collective_path_makes_allgather_unusable() -> None:
    d = choose_mode(node(kind="none", coll=0), MODEL_60, dp=8)
    assert d.mode == "rank_local"
    assert d.estimates["allgather"].block_seconds is None
    assert not d.estimates["allgather"].fits
    assert "no collective path" in d.reason


def test_nothing_fits_raises_with_estimates() -> None:
    with pytest.raises(PolicyError, match="no mode fits") as err:
        choose_mode(node(ram=100 * GB), MODEL_60, dp=8)
    assert set(err.value.estimates) == {"allgather", "rank_local", "resident"}


def test_headroom_counts_against_host_memory() -> None:
    # allgather needs 60 + 60 + 8 * F(60 GB) on the host
    need = 120 * GB + 8 * framework_bytes(60 * GB)
    assert estimate_modes(node(ram=need), MODEL_60, dp=8)["allgather"].fits
    assert not estimate_modes(node(ram=need), MODEL_60, dp=8, host_headroom_bytes=1)["allgather"].fits


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dp": 0}, "dp and sp"),
        ({"dp": 2, "sp": 0}, "dp and sp"),
        ({"dp": 2, "tokens_per_rank": 0}, "tokens_per_rank"),
        ({"dp": 2, "block_compute_seconds": -1.0}, "block_compute_seconds"),
    ],
)
def test_bad_arguments_raise_policy_error(kwargs: dict, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        choose_mode(node(), MODEL_60, **kwargs)


def test_profile_without_h2d_bandwidth_is_rejected() -> None:
    with pytest.raises(PolicyError, match="h2d_bandwidth_bps"):
        choose_mode(node(h2d=0), MODEL_60, dp=8)


def test_plan_json_shape() -> None:
    d = choose_mode(node(), MODEL_60, dp=8, block_compute_seconds=0.003)
    doc = json.loads(json.dumps(d.plan_json()))
    assert set(doc) == {"choice", "modes", "device_budget_bytes"}
    assert doc["device_budget_bytes"] == 48 * GB
    assert set(doc["choice"]) == {"mode", "reason"}
    assert set(doc["modes"]) == {"allgather", "rank_local", "resident"}
    for est in doc["modes"].values():
        assert set(est) == {
            "pinned_host_bytes", "page_cache_bytes", "cold_start_peak_bytes",
            "device_weight_bytes", "block_seconds", "fits", "device_peak_bytes",
        }
    assert Decision.model_validate({"mode": d.mode, "reason": d.reason, "estimates": doc["modes"],
                                    "device_budget_bytes": doc["device_budget_bytes"]}) == d


def test_rank_local_engine_spelling() -> None:
    d = choose_mode(node(), MODEL_60, dp=8, block_compute_seconds=0.025)
    assert (d.mode, d.engine_mode) == ("rank_local", "rank-local")


def test_framework_constants_are_the_documented_fit() -> None:
    assert framework_bytes(0) == FRAMEWORK_BASE_BYTES
    assert framework_bytes(10 * GB) == int(FRAMEWORK_BASE_BYTES + FRAMEWORK_MODEL_RATIO * 10 * GB)


@settings(max_examples=200, deadline=None)
@given(
    model_gb=st.integers(1, 400),
    block_frac=st.floats(0.001, 0.2),
    dp=st.integers(1, 8),
    compute_ms=st.floats(0, 200),
    coll_gb=st.integers(0, 900),
    ram_gb=st.integers(64, 4000),
    device_gb=st.integers(16, 200),
)
def test_properties_of_any_decision(
    model_gb: int, block_frac: float, dp: int, compute_ms: float, coll_gb: int, ram_gb: int, device_gb: int
) -> None:
    model = ModelFacts(bytes=model_gb * GB, largest_block_bytes=max(1, int(model_gb * GB * block_frac)), blocks=10)
    profile = node(coll=coll_gb * GB, ram=ram_gb * GB, device_memory=device_gb * GB)
    try:
        d = choose_mode(profile, model, dp=dp, block_compute_seconds=compute_ms / 1e3)
    except PolicyError as e:
        assert not any(est.fits for est in e.estimates.values())
        return
    chosen = d.estimates[d.mode]
    assert chosen.fits
    # allgather never pins more than rank-local; no mode is faster than compute alone
    assert d.estimates["allgather"].pinned_host_bytes <= d.estimates["rank_local"].pinned_host_bytes
    for est in d.estimates.values():
        if est.block_seconds is not None:
            assert est.block_seconds >= compute_ms / 1e3 - 1e-12
    if d.mode != "resident":
        assert not d.estimates["resident"].fits
        others = [e.block_seconds for n, e in d.estimates.items() if n != "resident" and e.fits]
        assert chosen.block_seconds is not None
        assert chosen.block_seconds <= min(others) * 1.05 + 1e-12
    assert not math.isnan(chosen.block_seconds or 0.0)


def test_cpu_node_uses_host_memory_as_device_memory() -> None:
    # A node without accelerators (CPU ranks): a model that fits host RAM is resident, and every
    # rank's device weights count into host memory.
    cpu = node(vendor="none", count=0, device_memory=0, ram=24 * GB, coll=1 * GB, kind="none")
    small = ModelFacts(bytes=1 * GB, largest_block_bytes=50_000_000, blocks=20)
    assert choose_mode(cpu, small, dp=2).mode == "resident"
    big = ModelFacts(bytes=9 * GB, largest_block_bytes=300_000_000, blocks=30)
    d = choose_mode(cpu, big, dp=2, block_compute_seconds=0.01)
    # resident would need 2 x 9 GB of rank copies beside 9 GB of page cache: over 24 GB
    assert not d.estimates["resident"].fits and d.mode in ("rank_local", "allgather")


def test_the_policy_takes_model_facts_and_names_modes_from_the_shared_vocabulary() -> None:
    from dlo.plan.profile import ModelProfile
    from dlo.plan.facts import MODE_KEYS, MODES

    entry = ModelProfile(bytes=60 * GB, largest_block_bytes=1_200_000_000, blocks=50)
    with pytest.raises(TypeError, match="ModelFacts"):
        choose_mode(node(), entry, dp=8)  # type: ignore[arg-type]
    d = choose_mode(node(), entry.facts(), dp=8, block_compute_seconds=0.003)
    assert tuple(d.estimates) == MODE_KEYS and d.engine_mode in MODES


def test_without_bandwidth_memory_and_fit_are_answered_and_times_are_unknown() -> None:
    from dlo.plan.policy import NoModeFits

    no_bw = node(h2d=0)
    with pytest.raises(PolicyError, match="h2d_bandwidth_bps"):
        choose_mode(no_bw, MODEL_60, dp=8)  # the default: the engine and the operator need times
    est = estimate_modes(no_bw, MODEL_60, dp=8, require_bandwidth=False)
    timed = estimate_modes(node(), MODEL_60, dp=8)
    for name in ("allgather", "rank_local", "resident"):
        # the memory model is the same with or without a bandwidth
        assert est[name].model_dump(exclude={"block_seconds"}) == timed[name].model_dump(exclude={"block_seconds"})
    assert est["allgather"].block_seconds is None and est["rank_local"].block_seconds is None
    assert est["resident"].block_seconds == 0.0  # no weight moves: compute only
    d = choose_mode(no_bw, MODEL_60, dp=8, require_bandwidth=False)
    assert d.mode == "allgather" and "both fit" in d.reason and "no H2D bandwidth" in d.reason
    one = choose_mode(no_bw, MODEL_60, dp=8, host_headroom_bytes=1800 * GB, require_bandwidth=False)
    assert one.mode == "allgather" and "rank_local does not fit" in one.reason and "unknown" in one.reason
    small = ModelFacts(bytes=10 * GB, largest_block_bytes=200_000_000, blocks=50)
    assert choose_mode(no_bw, small, dp=8, require_bandwidth=False).mode == "resident"
    with pytest.raises(NoModeFits):
        choose_mode(node(h2d=0, ram=100 * GB), MODEL_60, dp=8, require_bandwidth=False)


def test_nothing_fits_is_no_mode_fits_and_bad_input_is_not() -> None:
    from dlo.plan.policy import NoModeFits

    with pytest.raises(NoModeFits) as err:
        choose_mode(node(ram=100 * GB), MODEL_60, dp=8)
    assert err.value.estimates
    for kwargs in ({"dp": 0}, {"dp": 2, "tokens_per_rank": 0}):
        with pytest.raises(PolicyError) as bad:
            choose_mode(node(), MODEL_60, **kwargs)
        assert not isinstance(bad.value, NoModeFits)


def test_host_ranks_without_a_collective_bandwidth_can_still_gather() -> None:
    # CPU ranks gather through host memory (gloo): an unknown collective bandwidth leaves allgather's
    # time unknown; on accelerators the same zero means no path and allgather cannot run.
    cpu = node(vendor="none", count=0, device_memory=0, ram=400 * GB, coll=0, kind="none")
    est = estimate_modes(cpu, MODEL_60, dp=8, block_compute_seconds=0.01)
    assert est["allgather"].fits and est["allgather"].block_seconds is None
    d = choose_mode(cpu, MODEL_60, dp=8, block_compute_seconds=0.01)
    assert d.mode == "allgather" and "collective bandwidth between host ranks" in d.reason
    gpu = estimate_modes(node(kind="none", coll=0), MODEL_60, dp=8)
    assert not gpu["allgather"].fits and gpu["allgather"].block_seconds is None

