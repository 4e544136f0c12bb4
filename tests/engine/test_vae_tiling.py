"""`--vae-tiling` and the decode peaks measured on the device: a request the plan would tile is
refused under `never`; the peaks cache is keyed by device, library versions and the model's files."""

from __future__ import annotations

import asyncio
import os

import pytest

from dlo.engine.families import pipeline_facts
from dlo.engine.request import Generation
from dlo.engine.settings import EngineSettings, OffloadSettings
from dlo.plan.limits import Limits
from dlo.plan.measured import MeasuredPeaks, load_peaks, model_digest, peaks_path, save_peaks
from dlo.plan.memory_model import Shape
from dlo.serving.control import RankConfig
from dlo.serving.errors import InvalidRequest
from dlo.serving.service import Engine, EngineOptions
from dlo.serving.waves import WaveQueue
from tests.engine.serving_helpers import tiny_pipeline

GEN = Generation(kind="video", prompt="waves", seed=1, width=64, height=64, steps=2, guidance_scale=5.0, frames=5,
                 fps=2)


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return tiny_pipeline(tmp_path_factory, "wan")


def _engine(model, tiling: str, tile_above: int) -> Engine:
    settings = EngineSettings(OffloadSettings("resident"), vae_tile_above_pixels=tile_above)
    cfg = RankConfig(model_dir=str(model), settings=settings, master_port=1, control_port=1)
    engine = Engine(cfg, limits=Limits(), facts=pipeline_facts(model), model_id="tiny",
                    options=EngineOptions(max_queue=4, wave_window_ms=1, vae_tiling=tiling))
    engine._loop = asyncio.get_running_loop()
    engine._queue = WaveQueue(1, 0.001, 4)
    engine.state = "ready"  # no ranks: the test plays the scheduler
    return engine


async def test_never_refuses_what_the_plan_would_tile_and_auto_queues_it(wan):
    just_below = 64 * 64 * 5 - 1  # the request decodes 64 x 64 x 5 pixels: one over the threshold
    never = _engine(wan, "never", just_below)
    assert never.decode_tiled(GEN)
    with pytest.raises(InvalidRequest, match=r"size 64x64 x 5 frames x 1: .*--vae-tiling never"):
        never.submit(GEN)
    assert len(never._queue) == 0  # type: ignore[arg-type]
    plain = _engine(wan, "never", 64 * 64 * 5)  # at the threshold: plain, served
    assert not plain.decode_tiled(GEN) and not plain.submit(GEN).done()
    auto = _engine(wan, "auto", just_below)  # auto tiles it (the response says so)
    assert auto.decode_tiled(GEN) and not auto.submit(GEN).done()


def test_measured_peaks_are_cached_per_device_versions_and_model_files(wan, tmp_path):
    shape = Shape(832, 480)
    peaks = MeasuredPeaks("NVIDIA H100 80GB HBM3", "torch 2.11.0 diffusers 0.42.1", model_digest(wan),
                          {("vae_decode", shape): 3_380_000_000}, 12.5)
    path = save_peaks(wan, peaks, cache_root=tmp_path)
    assert path.is_relative_to(tmp_path) and path.parent.name.endswith(model_digest(wan))
    again = load_peaks(wan, peaks.device, peaks.versions, cache_root=tmp_path)
    assert again == peaks and again.get("vae_decode", shape) == 3_380_000_000
    assert load_peaks(wan, "NVIDIA H200", peaks.versions, cache_root=tmp_path) is None  # another device
    assert load_peaks(wan, peaks.device, "torch 2.12.0 diffusers 0.42.1", cache_root=tmp_path) is None
    cfg = wan / "vae" / "config.json"
    text = cfg.read_text()
    try:
        cfg.write_text(text.replace("{", '{"_touched": 1, ', 1))  # the model's files changed
        assert load_peaks(wan, peaks.device, peaks.versions, cache_root=tmp_path) is None
    finally:
        cfg.write_text(text)


def test_the_cache_sits_beside_a_writable_model_and_elsewhere_beside_a_read_only_one(wan, tmp_path, monkeypatch):
    beside = peaks_path(wan, "dev", "v")
    assert beside.parent == wan / ".dlo-peaks"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # a read-only model folder (a PVC, a hostPath)
    elsewhere = peaks_path(wan, "dev", "v")
    assert elsewhere.is_relative_to(tmp_path / "dlo" / "peaks")


@pytest.mark.slow
@pytest.mark.parametrize("tiling,tiled", [("auto", False), ("always", True)])
def test_a_response_says_whether_its_decode_ran_tiled(wan, tmp_path, tiling, tiled):
    """The image response's X-DLO-VAE-Tiled and Server-Timing headers, a video job's vae_tiled and
    timings, the dlo_vae_tiled counter, and the plan's rule in /ready; /v1/models reports the limits the server holds requests to."""
    import requests

    from dlo.serving.launch import ServerProcess
    from tests.engine.serving_helpers import wait_until

    with ServerProcess(wan, "--dp", "1", "--mode", "resident", "--device", "cpu", "--small-limits",
                       "--vae-tiling", tiling, log_path=tmp_path / "serve.log") as srv:
        r = requests.post(srv.url + "/v1/images/generations", timeout=120,
                          json={"prompt": "a lighthouse", "size": "64x64", "seed": 1, "num_inference_steps": 1})
        assert r.status_code == 200, r.text
        assert r.headers["X-DLO-VAE-Tiled"] == ("true" if tiled else "false")
        # where the rank's seconds went, per phase (Server-Timing: the client's total less these is HTTP's)
        timing = dict(part.split(";dur=") for part in r.headers["Server-Timing"].split(", "))
        assert {"prepare", "denoise", "decode", "encode_output", "rank"} <= set(timing), timing
        assert sum(float(timing[k]) for k in ("prepare", "denoise", "decode", "encode_output")) <= float(timing["rank"]) + 1
        assert srv.ready_info()["plan"]["vae"]["tiling"] == tiling
        counted = sum(v for labels, v in srv.metrics().get("dlo_vae_tiled_total", []) if labels.get("kind") == "image")
        assert counted == (1 if tiled else 0)
        model = requests.get(srv.url + "/v1/models", timeout=30).json()["data"][0]
        assert model["limits"]["max_width"] == 128  # --small-limits
        # a video job says it too (vae_tiled), and once completed where its rank's seconds went
        job = requests.post(srv.url + "/v1/videos", timeout=60, json={
            "prompt": "a lighthouse", "size": "64x64", "seconds": "1", "num_frames": 5, "seed": 1,
            "num_inference_steps": 1}).json()
        assert job["vae_tiled"] is tiled, job
        done = {}
        wait_until(lambda: done.update(requests.get(f"{srv.url}/v1/videos/{job['id']}", timeout=30).json())
                   or done.get("status") in ("completed", "failed"), 120, "the video job ended")
        assert done["status"] == "completed" and done["vae_tiled"] is tiled, done
        assert {"prepare", "denoise", "decode", "encode_output"} <= set(done["timings"]), done


def test_a_shape_between_shapes_measured_on_the_device_is_interpolated_not_guessed():
    """The H100's measured 832x832 decodes of 1-4 images (bench/results/peaks-h100-2026-12-06-b-cache.json)
    bound a shape between them with their own line; outside them the table's guess stays a guess."""
    import dataclasses
    from pathlib import Path

    from dlo.plan.memory_model import Geometry, PipelineMemory, RequestBounds
    from dlo.plan.memory_table import MemoryTable

    cache = Path(__file__).resolve().parents[2] / "bench" / "results" / "peaks-h100-2026-12-06-b-cache.json"
    peaks = MeasuredPeaks.from_json(cache.read_text(), str(cache))
    plain = {k: v for k, v in peaks.points.items() if k[0] == "vae_decode"}  # images and videos (Wan's features)
    images = {k: v for k, v in plain.items() if k[1].width == 832 and k[1].height == 832}
    assert sorted(s.batch for _, s in images) == [1, 2, 3, 4]
    memory = PipelineMemory("wan", Geometry(16, 4), {}, {}, {}, RequestBounds(832, 832, 1, 4), 0, MemoryTable.load())
    between = Shape(832, 800, 1, 3)
    guessed, extrapolated = memory.predicted("vae_decode", between)
    assert extrapolated  # the table measured no such image batch
    measured = dataclasses.replace(memory, measured=plain)
    need, extrapolated = measured.predicted("vae_decode", between)
    two, three = images[("vae_decode", Shape(832, 832, 1, 2))], images[("vae_decode", Shape(832, 832, 1, 3))]
    # the line through every plain decode measured (images and videos) bounds them all from above: no
    # less than the measured decode of two such images, far below the table's guess
    assert not extrapolated and two < need < guessed and three < guessed / 2
    assert measured.predicted("vae_decode", Shape(1920, 1920, 1, 4))[1]  # beyond them: still a guess


def test_a_shape_that_ran_out_of_memory_does_not_fit_and_is_no_point_of_a_fit(wan, tmp_path):
    """A decode that ran out of the device's memory is kept as `AtLeast` that memory (through the
    cache file): at that shape nothing fits below it, and the line between measured shapes ignores
    it (its true need is unknown), where as an ordinary point it would bend the line."""
    import dataclasses
    from pathlib import Path

    from dlo.plan.memory_model import Geometry, PipelineMemory, RequestBounds
    from dlo.plan.memory_table import MemoryTable
    from dlo.plan.peak_values import AtLeast

    cache = Path(__file__).resolve().parents[2] / "bench" / "results" / "peaks-h100-2026-12-06-b-cache.json"
    plain = {k: v for k, v in MeasuredPeaks.from_json(cache.read_text(), str(cache)).points.items()
             if k[0] == "vae_decode"}
    oom = ("vae_decode", Shape(832, 832, 1, 8))
    peaks = MeasuredPeaks("NVIDIA H100 80GB HBM3", "v", model_digest(wan), {**plain, oom: AtLeast(85 * 10**9)})
    again = load_peaks(wan, peaks.device, peaks.versions, cache_root=tmp_path) if save_peaks(
        wan, peaks, cache_root=tmp_path) else None
    assert again is not None and isinstance(again.points[oom], AtLeast) and again.points[oom] == 85 * 10**9
    assert not isinstance(again.points[next(iter(plain))], AtLeast)
    memory = PipelineMemory("wan", Geometry(16, 4), {}, {}, {}, RequestBounds(832, 832, 1, 8), 0, MemoryTable.load())
    kept = dataclasses.replace(memory, measured=again.points)
    assert kept.predicted(*oom) == (85 * 10**9, False)  # at that very shape: does not fit below the card
    between = Shape(832, 832, 1, 7)  # beyond the shapes measured to fit (none covers it), below the one that did not
    big = 10**13  # a card of 10 TB: as a point of the line it would lift it far
    kept = dataclasses.replace(memory, measured={**plain, oom: AtLeast(big)})
    as_point = dataclasses.replace(memory, measured={**plain, oom: big})
    assert kept.predicted("vae_decode", between) == dataclasses.replace(memory, measured=plain).predicted(
        "vae_decode", between)  # the line through the measured shapes alone
    assert as_point.predicted("vae_decode", between)[0] > 2 * kept.predicted("vae_decode", between)[0]
