"""Fault isolation by phase on one rank (in-process): `run_assignment` fails a request alone when
its failure is outside the collective schedule, and raises (the engine restarts) when a forward
stopped between offloaded blocks. The test-only fault hook is off unless both variables are set."""

from __future__ import annotations

import dataclasses

import pytest

from dlo.serving.control import RankConfig
from dlo.serving.faults import FAULTS_ENV, HOOKS_ENV, FaultPlan, InjectedFault, install_rank_faults
from dlo.engine.request import Generation
from dlo.engine.settings import EngineSettings, OffloadSettings
from tests.engine.serving_helpers import tiny_pipeline

GEN = Generation(kind="image", prompt="a cat", seed=3, width=32, height=32, steps=2, guidance_scale=5.0)


def test_the_fault_hook_needs_both_variables():
    assert FaultPlan.from_env({}) is None
    assert FaultPlan.from_env({FAULTS_ENV: "encode:0"}) is None  # never armed by the plan alone
    assert FaultPlan.from_env({HOOKS_ENV: "1"}) is None
    plan = FaultPlan.from_env({HOOKS_ENV: "1", FAULTS_ENV: "encode:1:boom, decode:*"})
    assert plan is not None and len(plan.faults) == 2
    plan.check("encode", 0, "boom")  # other rank
    plan.check("encode", 1, "fine")  # other prompt
    with pytest.raises(InjectedFault):
        plan.check("encode", 1, "a boom b")
    with pytest.raises(InjectedFault):
        plan.check("decode", 7, "anything")


@pytest.mark.parametrize("text", ["nope:0", "encode", "encode:x"])
def test_a_malformed_fault_plan_is_refused(text):
    with pytest.raises(ValueError):
        FaultPlan.parse(text)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["rank-local", "resident"])
def test_each_phase_fails_its_request_alone_and_a_mid_forward_fault_is_fatal_only_with_offload(
        tmp_path_factory, mode):
    from dlo.serving.pipeline import ServingPipeline
    from dlo.serving.rank_main import run_assignment

    model = tiny_pipeline(tmp_path_factory, "wan")
    settings = EngineSettings(OffloadSettings(mode))
    pipe = ServingPipeline(model, settings, max_sequence_length=16)
    plan = ",".join(f"{p}:0:boom-{p}" for p in ["encode", "setup", "step", "decode", "png", "forward"])
    assert install_rank_faults(pipe, 0, {FAULTS_ENV: plan}) is None  # not armed: nothing installed
    assert install_rank_faults(pipe, 0, {HOOKS_ENV: "1", FAULTS_ENV: plan}) is not None
    cfg = RankConfig(str(model), settings, 0, 0)
    ref = run_assignment(pipe, cfg, 1, GEN, GEN).outputs
    expected = {"encode": "prepare", "setup": "prepare", "step": "denoise", "decode": "decode", "png": "encode_output"}
    for phase, where in expected.items():
        bad = dataclasses.replace(GEN, prompt=f"boom-{phase}")
        res = run_assignment(pipe, cfg, 2, bad, bad)
        assert res.outputs is None and res.error is not None
        assert (res.error.phase, res.error.type, res.error.client_fault) == (where, "InjectedFault", False)
        assert run_assignment(pipe, cfg, 3, GEN, GEN).outputs == ref, f"after a {phase} fault: other bytes"
    bad = dataclasses.replace(GEN, prompt="boom-forward")
    if mode == "resident":  # no gathers to keep in order: the request fails alone
        assert run_assignment(pipe, cfg, 4, bad, bad).error.phase == "denoise"
        assert run_assignment(pipe, cfg, 5, GEN, GEN).outputs == ref
    else:  # the prefetcher's order is lost: the rank fails, the engine restarts
        with pytest.raises(InjectedFault):
            run_assignment(pipe, cfg, 4, bad, bad)
        assert not pipe.order_intact()
