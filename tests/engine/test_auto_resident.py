"""`--resident-blocks auto` against an emulated device budget, and the VAE tiling rule of a budget.

The emulation (CPU has no device budget): `dlo serve`'s own planning (`dlo.plan.deployment.plan`
over the committed memory table, for a cuda device capped at B) is given a budget B, and the real load and request
path run with the plan it makes. Proved: what the engine itself accounts as placed on the device
(each streamed model's slots and resident bytes, every whole component's parameters), with the
table's overhead, plus the table's peak of the largest request the limits accept and the stated
margin, stays within B; one more block would not; the largest accepted request is served, its bytes
those of the resident pipeline; allgather ranks agree on the smallest plan. Not proved here: that the
table's peaks are right on a device (the GPU record's capped runs send the largest request)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dlo.plan.facts import ModelFacts
from dlo.plan.memory_model import Geometry, PipelineMemory, RequestBounds, placed_weight_bytes
from dlo.plan.memory_plan import margin_bytes, resident_plan, tiling_for_budget, within
from dlo.plan.memory_table import Fit, MemoryTable
from dlo.engine.request import Generation
from dlo.plan.budget import deployment_memory
from dlo.plan.deployment import LoraAsk, PlanAsk, plan
from dlo.plan.limits import SMALL
from dlo.plan.profile import NodeProfile
from dlo.engine.settings import EngineSettings, OffloadSettings
from dlo.plan.resident import NO_TILING, VAE_TILE_ABOVE_PIXELS, ResidentPlan
from tests.engine.dist_utils import run_ranks
from tests.engine.test_family_pipelines import preset_pipeline
from tests.engine.test_memory_model import SMALL_TABLE

GB = 10**9


def _largest_video(limits) -> Generation:
    frames = (limits.max_frames - 1) // 4 * 4 + 1
    return Generation(kind="video", prompt="a lighthouse", seed=3, width=limits.max_width // 16 * 16,
                      height=limits.max_height // 16 * 16, steps=2, guidance_scale=5.0, frames=frames, fps=2)


def test_auto_resident_blocks_fill_an_emulated_budget_and_the_largest_request_is_served(tmp_path_factory):
    from dlo.serving.pipeline import ServingPipeline

    model = preset_pipeline(tmp_path_factory, "tiny-wan2.1-t2v")
    memory = deployment_memory(model, SMALL)  # the committed table's Wan rows
    lean = memory.rank("rank-local")
    assert lean.request_bytes is not None
    block = memory.transformers["transformer"].largest_block_bytes
    fixed = lean.request_bytes + margin_bytes(lean.request_bytes)
    budget = lean.weights_bytes + fixed + int(2.5 * block)  # room for two of the transformer's blocks
    ask = PlanAsk(mode="rank-local", device="cuda", max_device_memory=budget, resident_blocks="auto")
    p = plan(ask, profile=NodeProfile(), transformer=memory.transformers["transformer"], pipeline=memory,
             limits=SMALL, device_memory=10**15)
    assert p.budget_bytes == budget and p.vae_tile_above_pixels == tiling_for_budget(memory, budget)[0]
    base = EngineSettings(OffloadSettings("rank-local", resident_blocks="auto"), stream_encoders=True)
    settings = dataclasses.replace(base, resident_plan=p.resident, vae_tile_above_pixels=p.vae_tile_above_pixels)
    assert settings.resident_plan is not None and any("resident_blocks=auto budget=" in r for r in p.reasons)
    assert p.resident_blocks == dict(p.resident.blocks)
    dep_memory = dataclasses.replace(memory, tile_above_pixels=p.vae_tile_above_pixels)

    pipe = ServingPipeline(model, settings, max_sequence_length=SMALL.max_sequence_length)
    try:
        reports = {name: m.report for name, m in pipe.models.items()}
        kept = {name: r.resident_blocks for name, r in reports.items()}
        assert kept == dict(settings.resident_plan.blocks) and kept["transformer"] >= 2
        predicted = dep_memory.rank("rank-local", 1, kept)
        # the engine's own accounting of what it placed: within the memory model's weights (which count
        # each kept block at the largest block's size), less the buffers a model computes at build (not
        # in its checkpoint: the table's overhead, measured on loads, bounds them) ...
        for name, m in pipe.models.items():
            r = m.report
            built = sum(b.numel() * b.element_size() for n, b in m.module.named_buffers() if n not in m._ckpt.tensors)
            assert r.slot_bytes + r.resident_bytes - built <= placed_weight_bytes(
                dep_memory.transformers.get(name) or dep_memory.encoders[name], "rank-local", 1, kept[name]), name
            assert r.slot_bytes + r.resident_bytes <= predicted.weights[name]
        assert all(pipe.component_bytes[n] <= predicted.weights[n] for n in pipe.component_bytes)
        # ... and with the largest accepted request's peak and the margin they stay within the budget
        assert predicted.weights_bytes + fixed <= budget
        assert predicted.weights_bytes + fixed + block > budget  # not one more transformer block
        gen = _largest_video(SMALL)
        served = pipe.run(gen).outputs
    finally:
        pipe.close()
    reference = ServingPipeline(model, EngineSettings(OffloadSettings("resident")),
                                max_sequence_length=SMALL.max_sequence_length)
    try:
        assert served == reference.run(gen).outputs
    finally:
        reference.close()


def _agree(rank: int, world: int, plan: ResidentPlan) -> dict[str, int]:
    from dlo.engine.offload import agree_on_resident_blocks

    room = plan.budget_bytes - rank * 3 * plan.block_bytes["transformer"]  # rank 1's device has less room
    return agree_on_resident_blocks(within(plan, room), "allgather", None, torch.device("cpu"))


@pytest.mark.slow
def test_allgather_ranks_keep_the_smallest_plan_of_the_group():
    plan = ResidentPlan(blocks={"transformer": 6, "text_encoder": 2}, block_bytes={"transformer": 10, "text_encoder": 4},
                        budget_bytes=1000, spare_bytes=5, encoders=("text_encoder",))
    # rank 1 is 30 bytes short, 25 beyond the spare: both encoder blocks, then two transformer blocks go
    assert within(plan, 970) == {"transformer": 4, "text_encoder": 0}
    assert run_ranks(2, _agree, plan, timeout=240) == [{"transformer": 4, "text_encoder": 0}] * 2


WAN_T = ModelFacts(bytes=28_640_000_000, largest_block_bytes=703_000_000, blocks=40, nonblock_bytes=500_000_000)
UMT5 = ModelFacts(bytes=11_360_000_000, largest_block_bytes=400_000_000, blocks=24, nonblock_bytes=2_100_000_000)


def _memory(geometry: Geometry, bounds: RequestBounds) -> PipelineMemory:
    table = MemoryTable.load(SMALL_TABLE)
    if geometry.temporal_factor == 0:  # an image family's rows: the decode in pixels alone
        wan = table.families["wan"]
        span = {"pixels": (262144.0, 4194304.0)}
        parts = {**wan.parts, "vae_decode": Fit(("pixels",), (3e8, 8000.0), 0.0, span),
                 "vae_decode_tiled": Fit(("pixels",), (6e8, 30.0), 0.0, span)}
        table = dataclasses.replace(table, families={"wan": dataclasses.replace(wan, parts=parts)})
    return PipelineMemory("wan", geometry, {"transformer": WAN_T}, {"text_encoder": UMT5}, {"vae": 508_000_000},
                          bounds, VAE_TILE_ABOVE_PIXELS, table)


def test_the_budget_decides_the_vae_tiling_only_where_the_plain_decode_cannot_fit():
    video = _memory(Geometry(16, 4), RequestBounds(832, 480, 17, 4, 512))  # four images decode the worst
    assert dataclasses.replace(video, tile_above_pixels=NO_TILING).rank("rank-local").extrapolated
    # the decodes the plan weighs, measured on the device (here: the table's figures, as if measured)
    video = dataclasses.replace(video, measured={(p, s): video.predicted(p, s)[0] for p, s in video.calibration_shapes()})
    lean = dataclasses.replace(video, tile_above_pixels=NO_TILING).rank("rank-local")
    assert not lean.extrapolated
    fits = lean.weights_bytes + lean.request_bytes + margin_bytes(lean.request_bytes)
    assert tiling_for_budget(video, fits)[0] == NO_TILING  # plain, as plain diffusers decodes, while it fits
    tile, why = tiling_for_budget(video, fits - 1)
    # the plain decode of the largest request does not fit: smaller decodes stay plain up to the
    # threshold where one would outgrow the largest request tiled, so the peak stays what all tiled gives
    assert 0 < tile < 832 * 480 * 4 and "does not fit" in why and f"plain up to {tile} " in why
    # exact first: the plain decodes the threshold leaves (and the tiled ones above it) fit the budget,
    # one pixel more would not
    # by the measured figures (a decode between the measured shapes whose figure is extrapolated stays plain)
    at = {t: dataclasses.replace(video, tile_above_pixels=t).trusted().rank("rank-local") for t in (tile, tile + 1)}
    need = {t: r.weights_bytes + r.request_bytes + margin_bytes(r.request_bytes) for t, r in at.items()}
    assert need[tile] <= fits - 1 < need[tile + 1]
    assert tiling_for_budget(video, fits - 1, "always")[0] == 0
    images = _memory(Geometry(16, 0), RequestBounds(1024, 1024, 1, 2, 512))
    lean = dataclasses.replace(images, tile_above_pixels=NO_TILING).rank("rank-local")
    fits = lean.weights_bytes + lean.request_bytes + margin_bytes(lean.request_bytes)
    # a tiled decode would leave room for resident blocks (image requests are copy-bound), but trading
    # exactness for speed is the user's choice: plain unless --vae-tiling always
    assert tiling_for_budget(images, fits + GB)[0] == NO_TILING
    assert tiling_for_budget(images, fits + GB, "always") == (0, tiling_for_budget(images, 1, "always")[1])


def test_an_extrapolated_peak_never_makes_a_decode_lossy():
    beyond = _memory(Geometry(16, 4), RequestBounds(1920, 1920, 129, 4, 512))
    lean = dataclasses.replace(beyond, tile_above_pixels=NO_TILING).rank("rank-local")
    assert lean.extrapolated
    trusted = dataclasses.replace(beyond, tile_above_pixels=NO_TILING).trusted().rank("rank-local")
    assert not trusted.extrapolated and trusted.request_bytes < lean.request_bytes  # the measured need less
    budget = trusted.weights_bytes + trusted.request_bytes + margin_bytes(trusted.request_bytes)
    tile, why = tiling_for_budget(beyond, budget)
    assert tile == NO_TILING and "extrapolated" in why and "dlo calibrate --peaks" in why


def test_resident_plan_fills_the_transformer_first_and_states_its_arithmetic():
    m = _memory(Geometry(16, 4), RequestBounds(832, 480, 17, 1, 512))
    lean = m.rank("rank-local")
    fixed = lean.request_bytes + margin_bytes(lean.request_bytes)
    per_block = 703_000_000 + 7_030_000  # the block and the table's 1% overhead
    plan, line = resident_plan(m, "rank-local", 1, lean.weights_bytes + fixed + 3 * per_block + 450_000_000)
    assert plan.blocks == {"transformer": 3, "text_encoder": 1}  # the encoder's smaller block fits the rest
    assert plan.block_bytes["transformer"] == per_block
    assert "kept transformer 3 of 40" in line and "margin" in line and "spare" in line
    assert m.rank("rank-local", 1, dict(plan.blocks)).weights_bytes + fixed <= plan.budget_bytes
    assert resident_plan(m, "resident", 1, 10**12)[0].blocks == {"transformer": 0, "text_encoder": 0}


def test_lora_adapters_count_against_the_budget_as_a_whole_component(tmp_path_factory):
    """`--lora-dir`'s adapters (and a merge scratch) live on every rank: `dlo serve`'s deployment
    holds them as a whole component, the plan keeps fewer blocks for them, and a given mode's verdict
    names them."""
    from dlo.plan.budget import LORA_COMPONENT, check_mode

    model = preset_pipeline(tmp_path_factory, "tiny-wan2.1-t2v")
    memory = deployment_memory(model, SMALL)
    assert LORA_COMPONENT not in memory.whole
    # CFG pairs' waiting lane: counted where they may run (sp 1), not otherwise
    assert PlanAsk().pairs_counted and deployment_memory(model, SMALL, cfg_pairs=True).paired_lane != (0, 0)
    assert not PlanAsk(cfg_pairs=False).pairs_counted and not PlanAsk(sp=2).pairs_counted
    assert memory.paired_lane == (0, 0)

    def weights(adapter_bytes: int) -> int | None:
        ask = PlanAsk(mode="rank-local", lora=LoraAsk(adapter_bytes=adapter_bytes))
        return plan(ask, profile=NodeProfile(), transformer=memory.transformers["transformer"],
                    pipeline=memory).weights_bytes

    assert weights(12345) - weights(0) >= 12345  # the plan holds them as a whole component

    plain = _memory(Geometry(16, 4), RequestBounds(832, 480, 17, 1, 512))  # Wan2.1-14B's 40 blocks
    block = plain.transformers["transformer"].largest_block_bytes
    with_lora = dataclasses.replace(plain, whole={**plain.whole, LORA_COMPONENT: 2 * block})  # as deployment does
    lean = plain.rank("rank-local")
    delta = with_lora.rank("rank-local").weights_bytes - lean.weights_bytes  # the adapters and their overhead
    assert delta >= 2 * block
    budget = lean.weights_bytes + lean.request_bytes + margin_bytes(lean.request_bytes) + delta + int(5.5 * block)

    def kept(memory: PipelineMemory, budget: int) -> int:
        return resident_plan(memory, "rank-local", 1, budget)[0].blocks["transformer"]

    assert kept(with_lora, budget) == kept(plain, budget) - 2 == 5  # the adapters take two blocks' room
    kept_plan = resident_plan(with_lora, "rank-local", 1, budget)[0]
    assert with_lora.rank("rank-local", 1, dict(kept_plan.blocks)).weights_bytes <= budget - kept_plan.spare_bytes
    assert LORA_COMPONENT in check_mode("rank-local", with_lora, budget, 1)


def test_dlo_serve_defaults_to_auto_resident_blocks_where_a_budget_is_known():
    from tests.engine.serving_helpers import serve_settings

    assert serve_settings([], "rank-local", "cuda").offload.resident_blocks == "auto"
    assert serve_settings([], "rank-local", "cpu").offload.resident_blocks == 0
    assert serve_settings(["--resident-blocks", "3"], "rank-local", "cuda").offload.resident_blocks == 3
