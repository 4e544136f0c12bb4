"""The video folder against other users and a full disk, with real `dlo serve` processes: the default
folder is private (a folder another user owns or may enter is refused at start, in one line); a
record or MP4 planted as a symbolic link is never read or served; a job whose completion could not
be recorded (no space left) comes back completed with its MP4 after a restart."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests

from dlo.engine.ports import free_port
from dlo.serving.videos import default_video_dir
from tests.delivery.test_cache import small_disk
from tests.engine.serving_helpers import tiny_pipeline
from tests.engine.test_video_jobs_survive import AUTH, _create, _kill, _serve, _wait

pytestmark = pytest.mark.slow


def test_the_default_folder_is_made_private(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    folder = default_video_dir(8000)
    assert folder == tmp_path / f"dlo-{os.geteuid()}" / "videos-8000"
    for path in (folder, folder.parent):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700 and path.stat().st_uid == os.geteuid()


def _plant(case: str, base: Path) -> str:
    """Make `base` (the private folder's place) unsafe as `case` says; the word the refusal names."""
    if case == "other-user":
        base.mkdir(mode=0o700)
        os.chown(base, 65534, 65534)
        return "belongs to user 65534"
    if case == "open-mode":
        base.mkdir()
        base.chmod(0o777)
        return "has mode 777"
    target = base.parent / "elsewhere"
    target.mkdir(mode=0o700)
    base.symlink_to(target)
    return "is not a folder"


@pytest.mark.parametrize("case", ["other-user", "open-mode", "link"])
def test_a_default_folder_someone_else_could_plant_in_is_refused_at_start(tmp_path_factory, tmp_path, case):
    model = tiny_pipeline(tmp_path_factory, "wan")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)
    words = _plant(case, tmp / f"dlo-{os.geteuid()}")
    cmd = [sys.executable, "-m", "dlo.cli.main", "serve", str(model), "--port", str(free_port()), "--dp", "1",
           "--mode", "resident", "--device", "cpu", "--small-limits", "--no-warmup"]
    proc = subprocess.Popen(cmd, env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        pytest.fail("dlo serve started on a video folder someone else could plant records in")
    assert proc.returncode == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("dlo serve: video jobs: ") and words in line and "--video-dir" in line, err


def _record(folder: Path, video_id: str, **extra: object) -> dict:
    now = int(time.time())
    return {"version": 1, "id": video_id, "created_at": now, "model": "tiny", "prompt": "planted", "seconds": "1",
            "size": "64x64", "steps": 1, "status": "completed", "completed_at": now, "expires_at": now + 3600,
            "error": None, **extra}


def test_a_planted_link_is_never_read_or_served(tmp_path_factory, tmp_path):
    model = tiny_pipeline(tmp_path_factory, "wan")
    folder, elsewhere = tmp_path / "videos", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"a file the server can read, never a client")
    linked_mp4 = f"video_{uuid.uuid4().hex}"  # a regular record, its MP4 a link to the secret
    (folder / f"{linked_mp4}.json").write_text(json.dumps(_record(folder, linked_mp4)))
    (folder / f"{linked_mp4}.mp4").symlink_to(secret)
    linked_record = f"video_{uuid.uuid4().hex}"  # the record a link to one outside, its MP4 regular
    (elsewhere / "record.json").write_text(json.dumps(_record(folder, linked_record)))
    (folder / f"{linked_record}.json").symlink_to(elsewhere / "record.json")
    (folder / f"{linked_record}.mp4").write_bytes(b"not an mp4 the server made")
    with _serve(model, tmp_path, "planted", "--video-dir", str(folder)) as srv:
        for video_id in (linked_mp4, linked_record):
            r = requests.get(f"{srv.url}/v1/videos/{video_id}/content", headers=AUTH, timeout=30)
            assert r.status_code != 200 and secret.read_bytes() not in r.content, (video_id, r.status_code)
        status = requests.get(f"{srv.url}/v1/videos/{linked_record}", headers=AUTH, timeout=30).status_code
        assert status == 404
    assert secret.read_bytes() == b"a file the server can read, never a client"


def test_a_finished_video_whose_record_could_not_be_written_comes_back_completed(tmp_path_factory, tmp_path):
    """A video folder of three inodes: the folder, the job's record, its MP4; recording the
    completion needs a fourth (ENOSPC), so the record still says queued when the server dies."""
    model = tiny_pipeline(tmp_path_factory, "wan")
    with small_disk(tmp_path / "videos", "16m,nr_inodes=3") as folder:
        first = _serve(model, tmp_path, "first", "--video-dir", str(folder), "--video-ttl", "900")
        with first:
            job = _create(first.url, num_frames=5, num_inference_steps=1, seed=1)
            done = _wait(first.url, job["id"], ("completed", "failed"))
            assert done["status"] == "completed", done
            mp4 = requests.get(f"{first.url}/v1/videos/{job['id']}/content", headers=AUTH, timeout=30).content
            assert json.loads((folder / f"{job['id']}.json").read_text())["status"] == "queued"
            _kill(first)
        second = _serve(model, tmp_path, "second", "--video-dir", str(folder), "--video-ttl", "900")
        with second:
            again = requests.get(f"{second.url}/v1/videos/{job['id']}", headers=AUTH, timeout=30).json()
            assert again["status"] == "completed", again
            content = requests.get(f"{second.url}/v1/videos/{job['id']}/content", headers=AUTH, timeout=30)
            assert content.status_code == 200 and content.content == mp4
