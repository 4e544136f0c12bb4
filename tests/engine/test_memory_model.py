"""dlo.plan.memory_model and memory_table: the fits, a rank's peak over a small committed test
table, the largest requests of the limits, and the committed table holding nothing unmeasured."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from dlo.plan.facts import ModelFacts
from dlo.plan.memory_model import (
    Geometry,
    PipelineMemory,
    RequestBounds,
    Shape,
    largest_requests,
    pipeline_memory,
    placed_weight_bytes,
)
from dlo.plan.limits_fit import largest_fitting_size
from dlo.plan.memory_table import TABLE_PATH, MemoryTable, TableError, fit_linear

SMALL_TABLE = Path(__file__).parent / "fixtures" / "memory_table_small.json"
GB = 10**9
WAN_T = ModelFacts(bytes=28_640_000_000, largest_block_bytes=703_000_000, blocks=40, nonblock_bytes=500_000_000,
                   family="wan")
UMT5 = ModelFacts(bytes=11_360_000_000, largest_block_bytes=400_000_000, blocks=24, nonblock_bytes=2_100_000_000)
WAN_GEOMETRY = Geometry(size_multiple=16, temporal_factor=4)


def wan(bounds: RequestBounds, table: MemoryTable | None = None, tile_above: int = 10**12,
        stream: bool = True) -> PipelineMemory:
    return PipelineMemory("wan", WAN_GEOMETRY, {"transformer": WAN_T}, {"text_encoder": UMT5}, {"vae": 508_000_000},
                          bounds, tile_above, table if table is not None else MemoryTable.load(SMALL_TABLE), stream)


def test_fit_recovers_a_linear_model_and_bounds_every_point() -> None:
    rng = random.Random(0)
    points = []
    for _ in range(12):
        x = {"area": rng.uniform(1e5, 1e6), "pixels": rng.uniform(1e6, 1e8)}
        points.append((x, 2e8 + 3000 * x["area"] + 40 * x["pixels"] + rng.uniform(-1e6, 1e6)))
    fit = fit_linear(points, ("area", "pixels"), "vae_decode")
    assert fit.coef[1] == pytest.approx(3000, rel=0.01) and fit.coef[2] == pytest.approx(40, rel=0.01)
    assert all(fit.predict(x) >= y for x, y in points)  # the margin lifts the line over every point
    assert 0 < fit.margin <= 2e6
    assert not fit.extrapolated(points[0][0]) and fit.extrapolated({"area": 1e7, "pixels": 1e6})


def test_a_fit_the_shapes_do_not_determine_is_refused_naming_the_part() -> None:
    same_area = [({"area": 1e5, "pixels": p}, p) for p in (1e6, 2e6, 3e6)]
    with pytest.raises(TableError, match="wan vae_decode: the measured shapes do not vary"):
        fit_linear(same_area, ("area", "pixels"), "wan vae_decode")
    with pytest.raises(TableError, match="1 measured point"):
        fit_linear([({"tokens": 1.0}, 1.0)], ("tokens",), "transformer")


def test_the_committed_table_holds_only_fits_of_its_own_measured_points() -> None:
    table = MemoryTable.load(TABLE_PATH)
    for fam in table.families.values():
        for part, fit in fam.parts.items():
            assert fit.points, f"{fam.family} {part} has no measured points"
            refit = fit_linear(list(fit.points), fit.features, part)
            assert refit.coef == pytest.approx(fit.coef) and refit.margin == pytest.approx(fit.margin)
    for name in ("wan", "flux", "qwen-image", "wan-i2v"):  # unmeasured families say so: never a guess
        if table.family(name) is None:
            rank = wan(RequestBounds(832, 480, 17), table).rank("rank-local") if name == "wan" else None
            assert rank is None or (rank.request_bytes is None and "not in the memory table" in rank.unmeasured)


def test_largest_requests_follow_the_limits() -> None:
    bounds = RequestBounds(max_width=840, max_height=480, max_frames=19, max_n=3)
    assert largest_requests(bounds, WAN_GEOMETRY) == [Shape(832, 480, 17, 1), Shape(832, 480, 1, 3)]
    assert largest_requests(bounds, Geometry(16, 0)) == [Shape(832, 480, 1, 3)]  # images only
    assert largest_requests(bounds, Geometry(16, 4, image_input=True)) == [Shape(832, 480, 17, 1)]


def test_placed_weights_per_mode() -> None:
    assert placed_weight_bytes(WAN_T, "resident") == WAN_T.bytes
    assert placed_weight_bytes(WAN_T, "rank-local") == 500_000_000 + 2 * 703_000_000
    assert placed_weight_bytes(WAN_T, "rank_local", resident_blocks=3) == 500_000_000 + 5 * 703_000_000
    shard = -(-(-(-703_000_000 // 8)) // 256) * 256
    assert placed_weight_bytes(WAN_T, "allgather", 8) == 500_000_000 + 2 * 8 * shard


def test_fp8_streaming_places_half_slots_a_dequant_buffer_and_resident_blocks_in_bfloat16() -> None:
    fp8 = dataclasses.replace(WAN_T, largest_block_bytes=352_000_000, dequant_bytes=702_000_000,
                              compute_block_bytes=703_000_000, compute_bytes=WAN_T.bytes)
    assert placed_weight_bytes(fp8, "rank-local") == placed_weight_bytes(WAN_T, "rank-local") - 2 * 351_000_000 + 702_000_000
    assert placed_weight_bytes(fp8, "rank-local", resident_blocks=3) == 500_000_000 + 2 * 352_000_000 + 702_000_000 \
        + 3 * 703_000_000
    assert placed_weight_bytes(fp8, "resident") == WAN_T.bytes  # dequantized at placement


def test_a_ranks_peak_over_the_small_test_table() -> None:
    m = wan(RequestBounds(832, 480, 17, 1, 512))
    rank = m.rank("rank-local")
    assert rank.weights == {"transformer": 1_906_000_000 + 19_060_000, "text_encoder": 2_900_000_000 + 29_000_000,
                            "vae": 508_000_000 + 5_080_000}  # the table's weights overhead: 1% of each
    # the worst phase: one transformer call at 5 x 52 x 30 = 7,800 tokens (over the VAE decode, 1.67 GB)
    assert rank.worst == "transformer at 832x480x17"
    assert rank.request_bytes == 100_000_000 + 200_000 * 7800 + 50_000_000  # the part's fit and its margin
    assert rank.peak_bytes == rank.weights_bytes + rank.request_bytes
    resident = m.rank("resident")
    assert resident.weights_bytes == sum(b + round(0.01 * b) for b in (WAN_T.bytes, UMT5.bytes, 508_000_000))
    whole = dataclasses.replace(m, stream_encoders=False).rank("rank-local")
    assert whole.weights["text_encoder"] == UMT5.bytes + round(0.01 * UMT5.bytes)


def test_the_vae_tiles_above_the_threshold_and_the_worst_phase_follows() -> None:
    bounds = RequestBounds(832, 480, 1, 4, 512)  # four images: the decode of 4 x 832 x 480 is the worst phase
    area = 4 * 832 * 480
    plain = wan(bounds).rank("rank-local")
    assert plain.worst == "vae_decode at 832x480 n=4"
    assert plain.request_bytes == 200_000_000 + 3000 * area + 40 * area
    tiled = wan(bounds, tile_above=0).rank("rank-local")  # the engine's rule: tiles above it
    assert tiled.worst == "transformer at 832x480 n=4"  # tiled decode (0.96 GB) is below the call (1.4 GB)
    assert tiled.request_bytes < plain.request_bytes
    assert plain.extrapolated  # four images' area lies beyond the measured decodes: the model says so
    assert not wan(RequestBounds(832, 480, 17)).rank("rank-local").extrapolated


def test_a_threshold_below_the_largest_request_bounds_the_plain_decode_it_leaves() -> None:
    bounds = RequestBounds(832, 480, 1, 4, 512)
    area = 832 * 480
    m = wan(bounds, tile_above=2 * area)  # four images tile; two decode plain
    rank = m.rank("rank-local")
    plain_2 = 200_000_000 + 3000 * 2 * area + 40 * 2 * area
    assert rank.request_bytes == plain_2 and rank.worst == "vae_decode at 832x480 n=2"
    # without that bound the transformer call at four images (1.4 GB) would look the worst
    tiled_4 = 100_000_000 + 500 * 4 * area + 40 * 4 * area
    assert max(tiled_4, 100_000_000 + 200_000 * 4 * 52 * 30 + 50_000_000) < plain_2
    assert wan(bounds, tile_above=0).rank("rank-local").request_bytes < plain_2  # every decode tiled


@pytest.mark.parametrize("tile_above,worst,images,height", [
    (832 * 480 - 1, "vae_decode at 832x479", 1, 479),  # one image tiles, a smaller one (832x464) plain
    (5 * 832 * 480 // 2, "vae_decode at 832x400 n=3", 3, 400),  # 2.5 images' area: three smaller ones
])
def test_the_plain_decodes_under_a_threshold_are_bounded_by_its_area_not_by_whole_largest_images(tile_above, worst,
                                                                                               images, height):
    rank = wan(RequestBounds(832, 480, 1, 4, 512), tile_above=tile_above).rank("rank-local")
    area = images * 832 * height
    assert rank.worst == worst and area <= tile_above < area + images * 832  # within a pixel row per image
    assert rank.request_bytes == 200_000_000 + 3000 * area + 40 * area


def test_an_unmeasured_family_or_part_says_so() -> None:
    empty = wan(RequestBounds(832, 480, 17), MemoryTable())
    rank = empty.rank("rank-local")
    assert rank.request_bytes is None and rank.peak_bytes is None and "not in the memory table" in rank.unmeasured
    partial = MemoryTable.load(SMALL_TABLE)
    fam = partial.families["wan"]
    no_tiles = dataclasses.replace(partial, families={"wan": dataclasses.replace(
        fam, parts={k: v for k, v in fam.parts.items() if k != "vae_decode_tiled"})})
    rank = wan(RequestBounds(1920, 1920, 129), no_tiles, tile_above=1).rank("rank-local")
    assert rank.request_bytes is None and "no measured vae_decode_tiled" in rank.unmeasured


def test_the_largest_size_a_budget_allows() -> None:
    m = wan(RequestBounds(1920, 1920, 81, 1, 512), tile_above=1280 * 720 * 81)
    weights = m.rank("rank-local").weights_bytes
    side = largest_fitting_size(m, "rank-local", 1, weights + 4 * GB)
    assert side is not None and side % 16 == 0 and side < 1920
    fits = dataclasses.replace(m.bounds, max_width=side, max_height=side)
    assert m.with_bounds(fits).rank("rank-local").peak_bytes <= weights + 4 * GB
    over = dataclasses.replace(m.bounds, max_width=side + 16, max_height=side + 16)
    assert m.with_bounds(over).rank("rank-local").peak_bytes > weights + 4 * GB
    assert largest_fitting_size(m, "rank-local", 1, weights // 2) is None
    # never a size below the family's smallest side (Cosmos3: 32 px), where no request is served
    floored = dataclasses.replace(m, geometry=dataclasses.replace(m.geometry, smallest_side=side + 16))
    assert largest_fitting_size(floored, "rank-local", 1, weights + 4 * GB) is None


def test_pipeline_memory_reads_a_pipeline_folder(tmp_path_factory: pytest.TempPathFactory) -> None:
    from tests.engine.serving_helpers import tiny_pipeline

    folder = tiny_pipeline(tmp_path_factory, "wan")
    m = pipeline_memory(folder, RequestBounds(64, 64, 9), tile_above_pixels=10**9, table=MemoryTable())
    assert m.family == "wan" and set(m.transformers) == {"transformer"} and set(m.encoders) == {"text_encoder"}
    from dlo.engine.checkpoint import cached_checkpoint

    assert set(m.whole) == {"vae"} and m.whole["vae"] == cached_checkpoint(folder / "vae").nbytes
    assert m.geometry == Geometry(16, 4, False, smallest_side=16)


def test_cfg_pairs_add_the_waiting_lane_to_a_rank_local_transformer_call_only() -> None:
    """[Note: CFG pairs]: while one lane runs a block the other holds its call's state (per latent
    token and per text token); counted in rank-local mode, where pairs run, on the transformer's
    phase alone."""
    bounds = RequestBounds(832, 480, 17, 1, 512)
    plain, paired = wan(bounds), dataclasses.replace(wan(bounds), paired_lane=(12_288, 10_240))
    lane = 7800 * 12_288 + 512 * 10_240  # 5 x 52 x 30 tokens
    assert paired.rank("rank-local").request_bytes == plain.rank("rank-local").request_bytes + lane
    assert paired.rank("allgather", 2).request_bytes == plain.rank("allgather", 2).request_bytes
    assert paired.rank("resident").request_bytes == plain.rank("resident").request_bytes
    assert paired.rank("rank-local").weights == plain.rank("rank-local").weights
    # images up to 1280x720: the VAE decode is the worst phase; the lane adds to the transformer's alone
    images = RequestBounds(1280, 720, 1, 1, 512)
    plain, paired = wan(images), dataclasses.replace(wan(images), paired_lane=(12_288, 10_240))
    assert plain.rank("rank-local").worst == paired.rank("rank-local").worst == "vae_decode at 1280x720"
    assert paired.rank("rank-local").request_bytes == plain.rank("rank-local").request_bytes


def test_pipeline_memory_counts_the_lane_where_asked_and_the_family_pairs(tmp_path_factory) -> None:
    from tests.engine.serving_helpers import tiny_pipeline

    bounds = RequestBounds(64, 64, 9)
    wan_dir = tiny_pipeline(tmp_path_factory, "wan")  # 2 heads of 16: dim 32
    assert pipeline_memory(wan_dir, bounds, tile_above_pixels=10**9, table=MemoryTable()).paired_lane == (0, 0)
    on = pipeline_memory(wan_dir, bounds, tile_above_pixels=10**9, table=MemoryTable(), cfg_pairs=True)
    # a latent token: a block's input and output (dim 32, bfloat16) and rotary cos and sin (head_dim 16,
    # float64 at most); a text token: its projected states
    assert on.paired_lane == (2 * 32 * 2 + 2 * 16 * 8, 32 * 2)
    flux = pipeline_memory(tiny_pipeline(tmp_path_factory, "flux"), RequestBounds(64, 64), tile_above_pixels=10**9,
                           table=MemoryTable(), cfg_pairs=True)
    assert flux.paired_lane == (0, 0)  # its pipeline does not pair
    from tests.engine.test_family_pipelines import preset_pipeline

    qwen = pipeline_memory(preset_pipeline(tmp_path_factory, "tiny-qwen-image"), RequestBounds(64, 64),
                           tile_above_pixels=10**9, table=MemoryTable(), cfg_pairs=True)
    # either stream's token: its input and output states (2 heads of 16) and a rotary table of 8 complex values
    assert qwen.paired_lane == (2 * 32 * 2 + 16 * 8,) * 2
