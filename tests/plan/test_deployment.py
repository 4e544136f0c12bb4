"""`dlo.plan.deployment.plan`: the one deployment plan `dlo serve`, `dlo plan` and the operator ask,
over the committed small memory table (Wan2.1-14B's dimensions: 40 blocks, 28.6 GB)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dlo.plan.budget import LORA_COMPONENT, DeviceBudgetError
from dlo.plan.deployment import DeploymentPlan, LoraAsk, PlanAsk, plan
from dlo.plan.facts import ModelFacts
from dlo.plan.limits import Limits
from dlo.plan.memory_model import Geometry, PipelineMemory, RequestBounds
from dlo.plan.memory_plan import margin_bytes, tiling_for_budget
from dlo.plan.memory_table import MemoryTable
from dlo.plan.profile import Accelerator, NodeProfile

GB = 10**9
FIXTURES = Path(__file__).resolve().parents[1] / "engine" / "fixtures"
WAN = ModelFacts(bytes=28_640_000_000, largest_block_bytes=703_000_000, blocks=40, nonblock_bytes=500_000_000)
LIMITS = Limits(max_width=832, max_height=480, max_frames=17, max_n=1)
NODE = NodeProfile(accelerator=Accelerator(vendor="nvidia", model="test", count=1, memory_bytes=80 * GB),
                   h2d_bandwidth_bps=50 * GB, host_memory_bytes=10**12)


@pytest.fixture(scope="module")
def memory() -> PipelineMemory:
    table = MemoryTable.load(FIXTURES / "memory_table_small.json")
    return PipelineMemory("wan", Geometry(16, 4), {"transformer": WAN}, {}, {"vae": 508_000_000},
                          RequestBounds(832, 480, 17), 1280 * 720 * 81, table)


def _plan(memory: PipelineMemory, **ask) -> DeploymentPlan:
    return plan(PlanAsk(device="cuda", **ask), profile=NODE, transformer=WAN, pipeline=memory, limits=LIMITS,
                device_memory=80 * GB)


def test_a_plan_states_every_decision_and_is_frozen(memory):
    p = _plan(memory, mode="rank-local", resident_blocks="auto", max_device_memory=24 * 2**30)
    assert p.mode == "rank-local" and p.mode_reason == "--mode given" and p.budget_bytes == 24 * 2**30
    assert p.resident is not None and p.resident_blocks == dict(p.resident.blocks)
    assert 0 < p.resident_blocks["transformer"] < 40
    # the predicted peak per phase: weights plus each phase's need, within the budget with its margin
    assert {"transformer", "vae_decode"} <= set(p.peaks) and max(p.peaks.values()) <= p.budget_bytes
    assert p.weights_bytes is not None and min(p.peaks.values()) > p.weights_bytes
    doc = json.loads(json.dumps(p.to_dict()))
    assert doc["limits"]["max_frames"] == 17 and doc["resident_blocks"] == p.resident_blocks
    assert [r.split(" ")[0].rstrip(":") for r in doc["reasons"]] == ["device", "vae", "--mode", "mode",
                                                                   "resident_blocks=auto"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.mode = "resident"  # type: ignore[misc]


def test_a_given_mode_that_does_not_fit_is_refused_naming_the_budget_that_would(memory):
    with pytest.raises(DeviceBudgetError, match="--mode resident does not fit the device budget of 25.8 GB"):
        _plan(memory, mode="resident", max_device_memory=24 * 2**30)


def test_auto_asks_the_policy_with_the_pipeline_and_keeps_its_estimates(memory):
    roomy = _plan(memory)
    assert roomy.mode == "resident" and roomy.mode_reason.startswith("policy: ") and roomy.decision is not None
    assert set(roomy.estimates) == {"allgather", "rank_local", "resident"}
    capped = _plan(memory, max_device_memory=24 * 2**30)
    assert capped.mode != "resident" and capped.budget_bytes == 24 * 2**30


def test_the_node_profile_s_budget_caps_the_device_as_dlo_plan_did(memory):
    node = NODE.model_copy(update={"accelerator": NODE.accelerator.model_copy(update={"budget_bytes": 30 * GB})})
    p = plan(PlanAsk(device="cuda", mode="rank-local"), profile=node, transformer=WAN, pipeline=memory)
    assert p.budget_bytes == 30 * GB


def test_an_auto_merge_cache_takes_what_the_resident_blocks_leave(memory):
    lora = LoraAsk(adapter_bytes=GB, merges_bytes=50 * GB, served=True)
    p = _plan(memory, mode="rank-local", resident_blocks="auto", max_device_memory=24 * 2**30, lora=lora)
    assert p.lora_merge_cache_bytes == p.resident.spare_bytes and p.lora_merge_above_tokens == 0
    assert "lora merge cache auto" in p.reasons[-1]
    without = _plan(memory, mode="rank-local", resident_blocks="auto", max_device_memory=24 * 2**30)
    assert without.resident_blocks["transformer"] > p.resident_blocks["transformer"]  # the adapters take room
    assert p.weights_bytes - without.weights_bytes < GB + 703_000_000 * 2  # ... their bytes, less blocks
    assert LORA_COMPONENT not in without.peaks
    cpu = plan(PlanAsk(device="cpu", lora=lora), profile=NODE, transformer=WAN, pipeline=memory, limits=LIMITS)
    assert (cpu.lora_merge_cache_bytes, cpu.lora_merge_above_tokens) == (0, None) and cpu.budget_bytes is None


@pytest.mark.parametrize("slack", [-1, 0, 10 * GB])
def test_the_decode_rule_is_the_budget_s_whatever_the_mode(memory, slack):
    lean = memory.rank("rank-local")
    budget = lean.weights_bytes + lean.request_bytes + margin_bytes(lean.request_bytes) + slack
    want = tiling_for_budget(memory, budget)
    for mode in ("rank-local", "allgather"):
        p = _plan(memory, mode=mode, max_device_memory=budget)
        assert (p.vae_tile_above_pixels, p.tiling_reason) == want


def test_serve_plan_and_the_operator_give_one_mode_for_one_node(tmp_path):
    """`dlo plan --json`'s plan and the operator's per-node plan are the same call on the same inputs."""
    from dlo.operator.models import parse_spec
    from dlo.operator.modes import node_plan

    profile = tmp_path / "node.json"
    profile.write_text(NODE.model_dump_json())
    out = subprocess.run([sys.executable, "-m", "dlo.cli.main", "plan", "--model-bytes", str(WAN.bytes),
                          "--max-block-bytes", str(WAN.largest_block_bytes), "--dp", "1", "--profile", str(profile),
                          "--max-device-memory", "24GiB", "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    from_cli = json.loads(out.stdout)["plan"]
    spec = parse_spec({"model": {"path": "/models/wan", "facts": {"bytes": WAN.bytes,
                                                                  "largestBlockBytes": WAN.largest_block_bytes}},
                       "devicesPerNode": 1, "engine": {"maxDeviceMemory": "24GiB"}})
    facts = spec.model.facts.facts()
    op = node_plan(spec, NODE, facts)
    assert (op.mode, op.budget_bytes) == (from_cli["mode"], from_cli["budget_bytes"])


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory):
    from tests.engine.test_family_pipelines import preset_pipeline

    return preset_pipeline(tmp_path_factory, "tiny-wan2.1-t2v")


def _as_if_measured(folder, base):
    """Every phase of every candidate limit set, measured on the device (here: the table's figure)."""
    from dlo.plan.budget import deployment_memory
    from dlo.plan.limits_fit import candidates

    out = {}
    for limits in candidates(base, deployment_memory(folder, base).geometry):
        memory = deployment_memory(folder, limits)
        for tile in (0, memory.tile_above_pixels):
            for part, shape in dataclasses.replace(memory, tile_above_pixels=tile).phases():
                out[(part, shape)] = memory.predicted(part, shape, table_only=True)[0]
    return out


def _largest_fitting(folder, limits, budget, derive, measured):
    from dlo.plan.deployment import plan_folder

    ask = PlanAsk(mode="rank-local", device="cuda", max_device_memory=budget, measured=measured)
    return plan_folder(folder, ask, profile=NODE, limits=limits, device_memory=80 * GB, derive_limits=derive)


def test_limits_are_derived_from_the_budget_when_none_are_given(tiny_wan):
    """Frames first, then images, then size (never below the default sizes); the chosen limits are
    the plan's, and the reason says so. Given limits that cannot fit are refused naming sets that fit."""
    from dlo.plan.budget import deployment_memory

    base = Limits(max_width=256, max_height=256, max_frames=33, max_n=4, default_size="64x64",
                  default_video_size="64x64", max_sequence_length=64)
    measured = _as_if_measured(tiny_wan, base)
    smaller = base.model_copy(update={"max_frames": 17})
    def tiled(limits):  # every decode tiled: what a budget must hold at these limits at the least
        memory = deployment_memory(tiny_wan, limits)
        return dataclasses.replace(memory, measured=measured, tile_above_pixels=0).trusted().rank("rank-local")

    budget = tiled(smaller).peak_bytes  # a given mode fits where its peak does (the margin is the tiling rule's)
    assert tiled(base).peak_bytes > budget  # the given limits do not fit, tiled or not
    p = _largest_fitting(tiny_wan, base, budget, True, measured)
    assert p.limits is not None and p.limits.max_frames < base.max_frames
    assert p.reasons[0].startswith("limits derived from the device budget: ")
    with pytest.raises(DeviceBudgetError, match="limits that fit this budget: .*x 17 frames"):
        _largest_fitting(tiny_wan, base, budget, False, measured)


def test_with_no_limits_given_the_weights_stay_resident_at_the_largest_limits_that_keep_them(tiny_wan):
    """Mode auto on an accelerator: where the default limits would stream the weights but lower ones
    keep every weight on the device, the lower ones are derived (resident: the speed and bytes of plain
    diffusers), and the reason says how to accept larger requests; given limits are never lowered."""
    from dlo.plan.budget import deployment_memory
    from dlo.plan.deployment import plan_folder
    from dlo.plan.limits_fit import candidates

    base = Limits(max_width=256, max_height=256, max_frames=33, max_n=4, default_size="64x64",
                  default_video_size="64x64", max_sequence_length=64)
    measured = _as_if_measured(tiny_wan, base)

    def planned(budget, derive):
        ask = PlanAsk(device="cuda", max_device_memory=budget, measured=measured)
        return plan_folder(tiny_wan, ask, profile=NODE, limits=base, device_memory=80 * GB, derive_limits=derive)

    def attempt(budget, derive):
        try:
            return planned(budget, derive)
        except DeviceBudgetError:
            return None

    memory = deployment_memory(tiny_wan, base)
    whole = dataclasses.replace(memory, measured=measured).rank("resident")
    low, high = whole.weights_bytes, whole.peak_bytes * 2
    found = None
    for budget in range(low, high, max(1, (high - low) // 120)):
        given, derived = attempt(budget, False), attempt(budget, True)
        if (given is None or given.mode != "resident") and derived is not None and derived.mode == "resident":
            found = budget, given, derived
            break
    assert found is not None, "no budget keeps the weights resident only at lower limits"
    budget, given, derived = found
    assert derived.limits != base and derived.limits in list(candidates(base, memory.geometry))
    assert derived.reasons[0].startswith("limits derived from the device budget: ")
    assert "every weight stays on the device" in derived.reasons[0] and "--limits or --max-size" in derived.reasons[0]
    assert given is None or given.limits == base  # given limits stay as given: the weights stream instead


def test_each_limit_set_weighed_is_measured_first_and_a_shape_out_of_memory_lowers_the_limits(tiny_wan):
    """`plan_folder(measure=...)` (a start on the device): every candidate's pipeline memory goes to
    the measurer before it is weighed, the defaults first; where the measurer says the default
    limits' largest decode ran out of memory, the derived limits are lower and every phase the plan
    weighs is measured, none the table's."""
    from dlo.plan.deployment import plan_folder
    from dlo.plan.peak_values import AtLeast

    base = Limits(max_width=256, max_height=256, max_frames=33, max_n=4, default_size="64x64",
                  default_video_size="64x64", max_sequence_length=64)
    asked = []

    def measure(memory, extra):  # the device's answers: the table's figures, the largest video decode out of memory
        asked.append(memory.bounds)
        out = {}
        for tile in (0, memory.tile_above_pixels):
            for part, shape in dataclasses.replace(memory, tile_above_pixels=tile).phases():
                out[(part, shape)] = memory.predicted(part, shape, table_only=True)[0]
        for part, shape in memory.calibration_shapes():
            out.setdefault((part, shape), memory.predicted(part, shape, table_only=True)[0])
            if shape.frames == 33:
                out[(part, shape)] = AtLeast(80 * GB)
        return out

    ask = PlanAsk(mode="rank-local", device="cuda", max_device_memory=40 * GB)
    p = plan_folder(tiny_wan, ask, profile=NODE, limits=base, device_memory=80 * GB, derive_limits=True,
                    measure=measure)
    assert asked[0].max_frames == 33 and len(asked) >= 2  # the defaults first, then lower ones
    assert p.limits is not None and p.limits.max_frames < 33
    assert any(b.max_frames == p.limits.max_frames for b in asked)  # the chosen limits were measured
    assert p.needs and all(n["source"].startswith("measured") for n in p.needs), p.needs
    with pytest.raises(DeviceBudgetError, match="limits that fit this budget"):  # given limits: refused, named
        plan_folder(tiny_wan, ask, profile=NODE, limits=base, device_memory=80 * GB, measure=measure)
