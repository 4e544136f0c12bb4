"""Video jobs outlive a process and are answered by any pod: real `dlo serve` processes on localhost.

A restart on the same `--video-dir` keeps finished jobs (record and MP4) and reports the jobs that
were queued or running when the process was killed as failed (`server_restarted`). Two servers
named as two pods (`DLO_POD_NAME`, `DLO_PEER_URLS` standing in for the headless Service) answer
for each other's jobs: status, download and delete through the wrong pod, 502 once the job's pod
is gone.
"""

from __future__ import annotations

import json
import os
import signal

import openai
import pytest
import requests
from openai import OpenAI

from dlo.serving.launch import ServerProcess
from tests.engine.serving_helpers import tiny_pipeline, wait_until

pytestmark = pytest.mark.slow

KEY = "test-key-videos"
AUTH = {"Authorization": f"Bearer {KEY}"}
# small, but a job of 100 steps and 33 frames runs long enough to be caught in progress
LIMITS = {"max_width": 128, "max_height": 128, "max_steps": 100, "default_steps": 2, "max_frames": 33,
          "max_prompt_chars": 200, "max_sequence_length": 32, "video_fps": 2, "default_size": "64x64",
          "default_video_size": "64x64"}


def _serve(model, tmp_path, name: str, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
    (tmp_path / "limits.json").write_text(json.dumps(LIMITS))
    return ServerProcess(model, "--dp", "1", "--mode", "rank-local", "--device", "cpu", "--limits",
                         str(tmp_path / "limits.json"), *args, api_key=KEY, log_path=tmp_path / f"{name}.log", env=env)


def _create(url: str, **body) -> dict:
    r = requests.post(url + "/v1/videos", json={"prompt": "waves", "size": "64x64", **body}, headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _wait(url: str, video_id: str, statuses: tuple[str, ...], timeout: float = 90) -> dict:
    def get() -> dict:
        return requests.get(f"{url}/v1/videos/{video_id}", headers=AUTH, timeout=30).json()

    wait_until(lambda: get()["status"] in statuses, timeout, f"{video_id} is {' or '.join(statuses)}")
    return get()


def _kill(srv: ServerProcess) -> None:
    """SIGKILL the whole process group: no graceful shutdown, nothing written on the way out."""
    assert srv.proc is not None
    os.killpg(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(timeout=30)
    srv.stop()


def test_a_restart_keeps_finished_videos_and_fails_interrupted_ones(tmp_path_factory, tmp_path):
    model = tiny_pipeline(tmp_path_factory, "wan")
    folder = tmp_path / "videos"
    first = _serve(model, tmp_path, "first", "--video-dir", str(folder), "--video-ttl", "900",
                   env={"DLO_POD_NAME": "wan-0"})
    with first:
        done = _create(first.url, num_frames=5, num_inference_steps=1, seed=1)
        done = _wait(first.url, done["id"], ("completed", "failed"))
        assert done["status"] == "completed" and done["id"].startswith("video_wan-0_")
        mp4 = requests.get(f"{first.url}/v1/videos/{done['id']}/content", headers=AUTH, timeout=30).content
        running = _create(first.url, num_frames=33, num_inference_steps=100, size="128x128", seed=2)
        queued = _create(first.url, num_frames=5, num_inference_steps=1, seed=3)  # waits behind it (dp 1)
        _wait(first.url, running["id"], ("in_progress",))
        assert _wait(first.url, queued["id"], ("queued",))["status"] == "queued"
        _kill(first)

    second = _serve(model, tmp_path, "second", "--video-dir", str(folder), "--video-ttl", "900",
                    env={"DLO_POD_NAME": "wan-0"})
    with second:
        client = OpenAI(base_url=second.url + "/v1", api_key=KEY, max_retries=0)
        kept = client.videos.retrieve(done["id"])
        assert kept.status == "completed" and kept.expires_at == done["expires_at"] == done["completed_at"] + 900
        assert client.videos.download_content(done["id"]).read() == mp4
        for job in (running, queued):
            lost = client.videos.retrieve(job["id"])
            assert lost.status == "failed" and lost.error is not None and lost.error.code == "server_restarted"
            assert lost.expires_at is not None and lost.progress == 100
        assert {v.id for v in client.videos.list().data} == {done["id"], running["id"], queued["id"]}
        # and the restarted server serves new jobs as before
        fresh = _wait(second.url, _create(second.url, num_frames=5, num_inference_steps=1)["id"],
                      ("completed", "failed"))
        assert fresh["status"] == "completed"


def test_a_poll_reaching_the_wrong_pod_is_answered_by_the_jobs_pod(tmp_path_factory, tmp_path):
    model = tiny_pipeline(tmp_path_factory, "wan")
    a = _serve(model, tmp_path, "wan-0", "--video-dir", str(tmp_path / "a"))
    b = _serve(model, tmp_path, "wan-1", "--video-dir", str(tmp_path / "b"))
    peers = json.dumps({"wan-0": a.url, "wan-1": b.url})
    a.env.update(DLO_POD_NAME="wan-0", DLO_PEER_URLS=peers)
    b.env.update(DLO_POD_NAME="wan-1", DLO_PEER_URLS=peers)
    with a, b:
        job = _create(b.url, num_frames=5, num_inference_steps=2, seed=5)
        assert job["id"].startswith("video_wan-1_")
        via_a = OpenAI(base_url=a.url + "/v1", api_key=KEY, max_retries=0)
        # polled through the other pod from the start
        wait_until(lambda: via_a.videos.retrieve(job["id"]).status in ("completed", "failed"), 90,
                   "the job ended, seen through the other pod")
        video = via_a.videos.retrieve(job["id"])
        assert video.status == "completed", video.error
        direct = requests.get(f"{b.url}/v1/videos/{job['id']}/content", headers=AUTH, timeout=30).content
        assert via_a.videos.download_content(job["id"]).read() == direct and direct[4:8] == b"ftyp"
        assert job["id"] not in [v.id for v in via_a.videos.list().data]  # a's own jobs only
        assert requests.get(f"{a.url}/v1/videos/{job['id']}", timeout=30).status_code == 401
        deleted = via_a.videos.delete(job["id"])
        assert deleted.deleted and deleted.id == job["id"]
        with pytest.raises(openai.NotFoundError):
            OpenAI(base_url=b.url + "/v1", api_key=KEY, max_retries=0).videos.retrieve(job["id"])

        other = _create(b.url, num_frames=5, num_inference_steps=1)
        b.stop()
        r = requests.get(f"{a.url}/v1/videos/{other['id']}", headers=AUTH, timeout=60)
        # its pod is gone and the folders are not shared: no one can answer for it (404, never a 502)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
