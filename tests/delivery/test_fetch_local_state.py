"""`dlo fetch` against hostile or broken local state: a published folder damaged after the fetch, a
disk that fills mid-fetch, a second fetch into the same DEST, a failed fetch's staging folder, and a
staging folder that dlo did not make. Each answers in one line with a result file; nothing that
the fetch did not make is deleted or published."""

from __future__ import annotations

import fcntl
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dlo.delivery.staging import staging_dir
from tests.delivery.conftest import dlo_fetch, files_of, result_of, upload
from tests.delivery.test_cache import small_disk
from tests.delivery.test_fetch_hostile import one_line
from tests.engine.serving_helpers import wait_until

pytestmark = pytest.mark.slow


def fetch(s3, prefix: str, dest: Path, *extra: str, **kwargs):
    return dlo_fetch(f"s3://local/{prefix}", str(dest), "--endpoint", s3.url, "--progress", "none", *extra,
                     env=s3.env(), **kwargs)


def failed(proc, result_file: Path, reason: str, code: int = 1) -> str:
    """The one line a failed fetch printed, after checking its exit code and result file."""
    assert proc.returncode == code, proc.stderr
    line = one_line(proc.stderr)
    assert line.startswith(f"dlo fetch: {reason}: "), line
    result = json.loads(result_file.read_text())
    assert (result["state"], result["reason"]) == ("failed", reason)
    return line


def test_a_published_folder_with_a_truncated_file_is_not_already_complete(s3, tiny_model, tmp_path):
    upload(s3.client(), tiny_model, "local", "trunc")
    dest = tmp_path / "cache" / "m"
    assert fetch(s3, "trunc", dest).returncode == 0
    weights = dest / "transformer" / "diffusion_pytorch_model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    proc = fetch(s3, "trunc", dest, "--result-file", str(tmp_path / "r.json"))
    line = failed(proc, tmp_path / "r.json", "verify")
    assert "transformer/diffusion_pytorch_model.safetensors" in line and "damaged" in line
    weights.unlink()
    line = failed(fetch(s3, "trunc", dest, "--result-file", str(tmp_path / "r.json")), tmp_path / "r.json", "verify")
    assert "is missing" in line


def test_a_disk_that_fills_mid_fetch_is_one_line_with_a_result_file(s3, tiny_model, tmp_path):
    """A file system out of inodes (ENOSPC while files are being made; the byte check passed)."""
    upload(s3.client(), tiny_model, "local", "full")
    with small_disk(tmp_path / "disk", "128m,nr_inodes=12") as disk:
        dest = disk / "m"
        proc = fetch(s3, "full", dest, "--result-file", str(tmp_path / "r.json"))
        line = failed(proc, tmp_path / "r.json", "disk_full")
        assert "No space left on device" in line and not dest.exists()


def test_a_second_fetch_into_the_same_dest_waits_then_refuses_in_one_line(s3, tiny_model, tmp_path):
    upload(s3.client(), tiny_model, "local", "lock")
    dest = tmp_path / "cache" / "m"
    dest.parent.mkdir()
    with open(dest.parent / ".m.lock", "w") as held:  # a fetch into DEST at work
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = fetch(s3, "lock", dest, "--lock-wait", "1", "--result-file", str(tmp_path / "r.json"))
        (dest.parent / ".m.lock").unlink()  # as the fetch that made it does, still holding it
    line = failed(proc, tmp_path / "r.json", "invalid")
    assert "another fetch is writing" in line and not dest.exists() and not staging_dir(dest).exists()
    assert fetch(s3, "lock", dest).returncode == 0  # the lock released: the fetch goes ahead
    assert files_of(dest) == files_of(tiny_model)
    assert sorted(p.name for p in dest.parent.iterdir()) == ["m"]  # no lock file, no staging folder left



def test_two_uris_into_one_dest_at_once_publish_one_and_refuse_the_other_in_one_line(s3, tiny_model, tmp_path):
    """Two fetches of different sources started together into one DEST: the lock lets one write; the
    other waits for it, then finds DEST published from the other URI and refuses in one line, the
    published folder untouched and nothing of its own left behind."""
    for prefix in ("one", "two"):
        upload(s3.client(), tiny_model, "local", prefix)
    dest = tmp_path / "cache" / "m"
    procs = {prefix: subprocess.Popen(
        [sys.executable, "-m", "dlo.cli.main", "fetch", f"s3://local/{prefix}", str(dest), "--endpoint", s3.url,
         "--progress", "none", "--result-file", str(tmp_path / f"{prefix}.json")],
        env=s3.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for prefix in ("one", "two")}
    outcomes = {prefix: (proc.wait(timeout=120), proc.stderr.read()) for prefix, proc in procs.items()}
    winners = [p for p, (code, _) in outcomes.items() if code == 0]
    assert len(winners) == 1, outcomes
    (loser,) = set(procs) - set(winners)
    code, stderr = outcomes[loser]
    line = one_line(stderr)
    assert code != 0 and line.startswith("dlo fetch: invalid: ") and f"published from s3://local/{loser}" in line, line
    assert json.loads((tmp_path / f"{loser}.json").read_text())["reason"] == "invalid"
    assert files_of(dest) == files_of(tiny_model)  # the winner's folder, whole
    assert sorted(p.name for p in dest.parent.iterdir()) == ["m"]  # no lock file, no staging folder left

def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 * 2**20, 2 * 2**20))


def upload_too_big(s3, tiny_model: Path, tmp_path: Path, prefix: str) -> None:
    """`prefix/big`: the tiny model with a 4 MiB file a fetch under `_limit_file_size` fails on;
    `prefix/tiny`: the tiny model."""
    big = tmp_path / "big"
    shutil.copytree(tiny_model, big)
    (big / "vae" / "extra.safetensors").write_bytes(os.urandom(4 * 2**20))
    upload(s3.client(), big, "local", f"{prefix}/big", part_size=8 * 2**20)
    upload(s3.client(), tiny_model, "local", f"{prefix}/tiny")


def test_a_failed_fetchs_staging_folder_is_reclaimed_by_the_next_fetch_of_another_source(s3, tiny_model, tmp_path):
    upload_too_big(s3, tiny_model, tmp_path, "stale")
    dest = tmp_path / "cache" / "m"
    first = fetch(s3, "stale/big", dest, "--result-file", str(tmp_path / "r.json"), preexec_fn=_limit_file_size)
    failed(first, tmp_path / "r.json", "disk_full")  # a file over the limit: the fetch fails part way
    assert staging_dir(dest).is_dir() and not dest.exists()
    second = fetch(s3, "stale/tiny", dest, "--json")
    assert second.returncode == 0, second.stderr
    assert files_of(dest) == files_of(tiny_model)  # nothing of the failed fetch's source published
    assert not staging_dir(dest).exists() and result_of(second)["state"] == "complete"


@pytest.mark.parametrize("source", ["pipeline", "not-a-pipeline"])
def test_a_staging_folder_dlo_did_not_make_is_refused_and_kept(s3, tiny_model, tmp_path, source):
    upload(s3.client(), tiny_model, "local", f"foreign/{source}")
    if source == "not-a-pipeline":
        s3.client().delete_object(Bucket="local", Key=f"foreign/{source}/model_index.json")
    dest = tmp_path / "cache" / "m"
    staging_dir(dest).mkdir(parents=True)
    (staging_dir(dest) / "notes.txt").write_text("someone else's")
    proc = fetch(s3, f"foreign/{source}", dest, "--result-file", str(tmp_path / "r.json"))
    if source == "pipeline":
        line = failed(proc, tmp_path / "r.json", "invalid")
        assert "was not made by dlo fetch" in line and str(staging_dir(dest)) in line
    assert proc.returncode != 0 and not dest.exists()
    assert (staging_dir(dest) / "notes.txt").read_text() == "someone else's"


def test_two_fetches_into_one_dest_run_one_after_the_other(s3, tiny_model, tmp_path):
    """The second waits for the first's lock, then finds DEST complete: one download, no mixing."""
    src = tmp_path / "src"
    shutil.copytree(tiny_model, src)
    (src / "vae" / "extra.safetensors").write_bytes(os.urandom(8 * 2**20))
    upload(s3.client(), src, "local", "twice", part_size=8 * 2**20)
    dest = tmp_path / "cache" / "m"
    argv = [sys.executable, "-m", "dlo.cli.main", "fetch", "s3://local/twice", str(dest), "--endpoint", s3.url,
            "--part-size", "128KiB", "--concurrency", "1", "--progress", "none", "--json"]
    first = subprocess.Popen(argv, env=s3.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: staging_dir(dest).exists() or first.poll() is not None, 60, "the first fetch writes",
               poll_s=0.01)
    assert first.poll() is None, "the first fetch ended before the second started"
    second = dlo_fetch(*argv[4:], env=s3.env())
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0 and second.returncode == 0, (err, second.stderr)
    assert json.loads(out.strip().splitlines()[-1])["already_complete"] is False
    assert result_of(second)["already_complete"] is True and result_of(second)["downloaded_bytes"] == 0
    assert files_of(dest) == files_of(src)
