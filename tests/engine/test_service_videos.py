"""serving/service.py's video side, without ranks: a job is recorded before it is queued, a
refused one leaves nothing behind (and its 429 carries a Retry-After hint), and every way its wave
can end (result, domain error, unexpected error) finishes the job."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dlo.engine.families.pipelines import PipelineFamily
from dlo.serving.control import RankConfig, RankStats, Result
from dlo.serving.errors import EngineFailed, QueueFull
from dlo.plan.limits import Limits
from dlo.serving.service import Engine, EngineOptions
from dlo.serving.videos import VideoStore
from dlo.engine.request import Generation
from dlo.serving.waves import WaveQueue
from dlo.engine.settings import EngineSettings, OffloadSettings

GEN = Generation(kind="video", prompt="waves", seed=1, width=64, height=64, steps=2, guidance_scale=5.0, frames=5,
                 fps=2)


def _engine(tmp_path, max_queue: int) -> Engine:
    cfg = RankConfig(model_dir=str(tmp_path), settings=EngineSettings(OffloadSettings("resident")), master_port=1,
                     control_port=1)
    store = VideoStore(tmp_path / "videos", ttl_s=60, pod="wan-0")
    store.load()
    facts = SimpleNamespace(adapter=PipelineFamily())  # the family's decode rule is all a submit reads
    engine = Engine(cfg, limits=Limits(), facts=facts, model_id="tiny", videos=store,  # type: ignore[arg-type]
                    options=EngineOptions(progress_timeout_s=10, max_queue=max_queue, wave_window_ms=1))
    engine._loop = asyncio.get_running_loop()
    engine._queue = WaveQueue(1, 0.001, max_queue)
    engine.state = "ready"  # no ranks: the test plays the scheduler
    return engine


async def _settled(engine: Engine, video_id: str) -> str:
    for _ in range(1000):
        status = engine.videos.get(video_id).status
        if status in ("completed", "failed"):
            return status
        await asyncio.sleep(0.005)
    raise AssertionError(f"{video_id} never finished")


async def test_a_refused_job_leaves_no_record_and_its_refusal_carries_a_retry_hint(tmp_path):
    engine = _engine(tmp_path, max_queue=0)
    with pytest.raises(QueueFull) as e:
        engine.jobs.create(GEN, "2.5")
    assert e.value.retry_after_s >= 1
    assert len(engine.videos) == 0 and not list(engine.videos.folder.iterdir())


async def test_every_way_a_wave_ends_finishes_the_job(tmp_path):
    engine = _engine(tmp_path, max_queue=8)
    jobs = [engine.jobs.create(GEN, "2.5") for _ in range(3)]
    assert all((engine.videos.folder / f"{j.id}.json").exists() and j.status == "queued" for j in jobs)
    waiting = engine._queue.drain()  # type: ignore[union-attr]
    ok = Result(wave=1, stats=RankStats(), outputs=(b"\x00\x00\x00\x18ftypmp42",), media_type="video/mp4")
    waiting[0].future.set_result(ok)
    waiting[1].future.set_exception(EngineFailed("engine failed: rank 1 died"))
    waiting[2].future.set_exception(TypeError("a bug"))
    assert [await _settled(engine, j.id) for j in jobs] == ["completed", "failed", "failed"]
    assert engine.videos.content_path(jobs[0].id).read_bytes() == ok.outputs[0]
    assert engine.videos.get(jobs[1].id).error == {"code": "engine_failed", "message": "engine failed: rank 1 died"}
    assert engine.videos.get(jobs[2].id).error["code"] == "internal_error"
    assert all(engine.jobs.progress(j) == 100 for j in jobs)
    failures = {s.labels["code"]: s.value for fam in engine.metrics.video_job_failures.collect() for s in fam.samples
                if s.name.endswith("_total")}
    assert failures == {"engine_failed": 1.0, "internal_error": 1.0}
    assert engine.metrics.video_job_duration.collect()[0].samples[-2].value == 1  # _count: the completed one
    assert engine.videos.by_status() == {"queued": 0, "in_progress": 0, "completed": 1, "failed": 2}
