"""serving/videos.py: the video job store (ids, lifecycle, listing, deletion, expiry, disk)."""

from __future__ import annotations

import json

import pytest

from dlo.serving.errors import (
    VideoElsewhere,
    VideoJobsFull,
    VideoNotFinished,
    VideoNotFound,
    VideoNotReady,
    VideoStorageError,
    VideoStoreReadOnly,
)
from dlo.serving.videos import VideoJob, VideoStore, pod_of


class Clock:
    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _job(store: VideoStore, created_at: int, prompt: str = "waves") -> VideoJob:
    return store.add(VideoJob(id=store.new_id(), created_at=created_at, model="tiny", prompt=prompt, seconds="4.5",
                              size="64x64", steps=2))


def _store(tmp_path, clock: Clock, **kw) -> VideoStore:
    store = VideoStore(tmp_path / "videos", ttl_s=kw.pop("ttl_s", 600), clock=clock, **kw)
    store.load()
    return store


def test_ids_name_the_pod_and_a_job_of_another_pod_is_elsewhere(tmp_path):
    store = _store(tmp_path, Clock(), pod="wan-0")
    job = _job(store, 1)
    assert job.id.startswith("video_wan-0_") and pod_of(job.id) == "wan-0"
    assert store.get(job.id) is job and store.owner(job.id) is None
    other = job.id.replace("wan-0", "wan-1")
    with pytest.raises(VideoElsewhere) as e:
        store.get(other)
    assert e.value.pod == "wan-1"
    with pytest.raises(VideoNotFound):
        store.get("video_nope")
    unnamed = VideoStore(tmp_path / "solo", clock=Clock())
    assert pod_of(unnamed.new_id()) is None


def test_pod_name_and_ttl_are_checked():
    with pytest.raises(ValueError, match="DNS label"):
        VideoStore("/nonexistent", pod="Wan_0")
    with pytest.raises(ValueError, match="TTL"):
        VideoStore("/nonexistent", ttl_s=0)


def test_lifecycle_sets_expires_at_and_writes_files_atomically(tmp_path):
    clock = Clock()
    store = _store(tmp_path, clock, pod="wan-0")
    job = _job(store, 1)
    sidecar = store.folder / f"{job.id}.json"
    assert json.loads(sidecar.read_text())["status"] == "queued"  # recorded before it runs
    with pytest.raises(VideoNotReady):
        store.content_path(job.id)
    store.start(job.id, rank=1)
    assert job.status == "in_progress" and job.rank == 1
    store.write_content(job.id, b"mp4 bytes")
    clock.now += 5
    store.complete(job.id)
    assert job.status == "completed" and job.completed_at == int(clock.now)
    assert job.expires_at == job.completed_at + 600
    assert store.content_path(job.id).read_bytes() == b"mp4 bytes"
    saved = json.loads(sidecar.read_text())
    assert saved["status"] == "completed" and saved["expires_at"] == job.expires_at
    assert not list(store.folder.glob(".*"))  # no temp file left behind


def test_failed_jobs_expire_too_and_their_content_is_refused(tmp_path):
    clock = Clock()
    store = _store(tmp_path, clock)
    job = _job(store, 1)
    store.fail(job.id, "engine_failed", "rank 1 died")
    assert job.status == "failed" and job.error == {"code": "engine_failed", "message": "rank 1 died"}
    assert job.expires_at == int(clock.now) + 600
    with pytest.raises(VideoNotReady) as e:
        store.content_path(job.id)
    assert e.value.failed


def test_list_pages_with_the_openai_cursor_in_both_orders(tmp_path):
    store = _store(tmp_path, Clock())
    ids = [_job(store, t).id for t in (10, 20, 30, 40, 50)]
    page, more = store.list(limit=2)
    assert [j.id for j in page] == ids[::-1][:2] and more
    page, more = store.list(limit=2, after=page[-1].id)
    assert [j.id for j in page] == ids[::-1][2:4] and more
    page, more = store.list(limit=2, after=page[-1].id)
    assert [j.id for j in page] == ids[:1] and not more
    page, more = store.list(limit=10, order="asc")
    assert [j.id for j in page] == ids and not more
    with pytest.raises(VideoNotFound) as e:
        store.list(after="video_0123")
    assert e.value.param == "after"


def test_delete_removes_finished_jobs_and_files_and_refuses_unfinished_ones(tmp_path):
    store = _store(tmp_path, Clock())
    job = _job(store, 1)
    with pytest.raises(VideoNotFinished):
        store.delete(job.id)
    store.start(job.id, 0)
    with pytest.raises(VideoNotFinished):
        store.delete(job.id)
    store.write_content(job.id, b"x")
    store.complete(job.id)
    assert store.delete(job.id) is job
    assert job.id not in store and not list(store.folder.iterdir())
    with pytest.raises(VideoNotFound):
        store.get(job.id)


def test_expired_jobs_and_their_files_are_removed(tmp_path):
    clock = Clock()
    store = _store(tmp_path, clock, ttl_s=60)
    done, running = _job(store, 1), _job(store, 2)
    store.write_content(done.id, b"x")
    store.complete(done.id)
    clock.now += 59
    assert store.sweep() == 0 and store.get(done.id) is done
    clock.now += 1
    with pytest.raises(VideoNotFound):
        store.get(done.id)
    assert sorted(p.name for p in store.folder.iterdir()) == [f"{running.id}.json"]  # running jobs never expire


def test_a_restart_keeps_finished_jobs_fails_unfinished_ones_and_drops_expired_ones(tmp_path):
    clock = Clock()
    store = _store(tmp_path, clock, pod="wan-0", ttl_s=100)
    done, queued, running, old = (_job(store, t, prompt=f"p{t}") for t in (1, 2, 3, 4))
    for job in (done, old):
        store.write_content(job.id, b"mp4-" + job.id.encode())
    store.complete(old.id)
    clock.now += 50
    store.complete(done.id)
    store.start(running.id, 0)
    (store.folder / ".half-written.json.tmp").write_text("{")  # a write the process did not finish
    (store.folder / "video_broken.json").write_text("{not json")
    clock.now += 60  # `old` expired while the process was down

    again = _store(tmp_path, clock, pod="wan-0", ttl_s=100)
    assert {j.id for j in again.list(limit=100)[0]} == {done.id, queued.id, running.id}
    back = again.get(done.id)
    assert back.status == "completed" and back.prompt == "p1" and back.expires_at == done.expires_at
    assert again.content_path(done.id).read_bytes() == b"mp4-" + done.id.encode()
    for job in (queued, running):
        lost = again.get(job.id)
        assert lost.status == "failed" and lost.error["code"] == "server_restarted"
        assert lost.completed_at == int(clock.now) and lost.expires_at == int(clock.now) + 100
    names = {p.name for p in again.folder.iterdir()}
    assert names == {f"{done.id}.json", f"{done.id}.mp4", f"{queued.id}.json", f"{running.id}.json"}
    assert json.loads((again.folder / f"{queued.id}.json").read_text())["status"] == "failed"


def test_a_completed_job_whose_file_is_gone_comes_back_failed(tmp_path):
    clock = Clock()
    store = _store(tmp_path, clock)
    job = _job(store, 1)
    store.write_content(job.id, b"x")
    store.complete(job.id)
    (store.folder / f"{job.id}.mp4").unlink()
    again = _store(tmp_path, clock)
    assert again.get(job.id).status == "failed" and again.get(job.id).error["code"] == "content_lost"


def _client_job(store: VideoStore, client: str) -> VideoJob:
    return store.add(VideoJob(id=store.new_id(), created_at=1, model="tiny", prompt="p", seconds="1", size="64x64",
                              steps=1, client=client))


def test_at_the_cap_new_jobs_are_refused_and_no_unexpired_job_is_evicted(tmp_path):
    clock = Clock()
    store = _store(tmp_path, clock, max_jobs=4, max_jobs_per_client=2, ttl_s=100)
    victim = _client_job(store, "10.0.0.1")
    store.fail(victim.id, "x", "y")  # finished, within its TTL
    _client_job(store, "10.0.0.2")
    _client_job(store, "10.0.0.2")
    with pytest.raises(VideoJobsFull, match="this client holds 2"):  # one client: its quota
        _client_job(store, "10.0.0.2")
    _client_job(store, "10.0.0.3")
    with pytest.raises(VideoJobsFull, match="maximum of 4"):  # everyone: the cap, and nobody is evicted
        _client_job(store, "10.0.0.4")
    assert victim.id in store and len(store) == 4
    clock.now += 101  # the finished job expires: its place is free again
    assert _client_job(store, "10.0.0.4").id in store and victim.id not in store


@pytest.fixture
def tmpfs(tmp_path):
    """A tmpfs mounted at a fresh folder; `remount_read_only()` turns it read-only (as a volume
    mounted readOnly, or a file system remounted read-only after an error, would be)."""
    import subprocess

    folder = tmp_path / "mnt"
    folder.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(folder)], check=True)

    def remount_read_only() -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)

    try:
        yield folder, remount_read_only
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def test_a_delete_on_a_read_only_folder_is_an_error_and_the_job_stays(tmpfs, caplog):
    folder, remount_read_only = tmpfs
    clock = Clock()
    store = VideoStore(folder / "videos", ttl_s=600, pod="wan-0", clock=clock)
    store.load()
    job = _job(store, 1)
    store.write_content(job.id, b"mp4")
    store.complete(job.id)
    remount_read_only()
    with pytest.raises(VideoStorageError, match="could not delete"):
        store.delete(job.id)
    assert store.get(job.id).status == "completed"
    assert {p.name for p in store.folder.iterdir()} == {f"{job.id}.json", f"{job.id}.mp4"}
    again = VideoStore(folder / "videos", ttl_s=600, pod="wan-0", clock=clock)
    with caplog.at_level("WARNING"):
        again.load()  # a restart on the read-only folder: said at start, finished jobs still served
    assert any("read-only" in r.message for r in caplog.records if r.levelname == "WARNING")
    assert again.content_path(job.id).read_bytes() == b"mp4"
    with pytest.raises(VideoStoreReadOnly, match="takes no video jobs"):
        _job(again, 2)
