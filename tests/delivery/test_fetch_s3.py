"""`dlo fetch s3://...` against moto's S3 server on loopback, with the real boto3 client: byte-identical
folders, an idempotent second fetch, resume after a kill, refusal of what is not a pipeline, wrong
credentials with authentication on, and ETag checks that hold for multipart objects."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlo.delivery.pipeline import SourceFile
from dlo.delivery.staging import STATE, staging_dir
from tests.delivery.conftest import dlo_fetch, files_of, result_of, start_moto, upload

pytestmark = pytest.mark.slow


def test_fetch_is_byte_identical_then_a_second_fetch_downloads_nothing(s3, tiny_model, tmp_path):
    upload(s3.client(), tiny_model, "models", "pipelines/tiny-wan")
    dest = tmp_path / "cache" / "tiny-wan"
    uri = "s3://models/pipelines/tiny-wan"
    first = dlo_fetch(uri, str(dest), "--endpoint", s3.url, "--json", "--progress", "plain", env=s3.env())
    assert first.returncode == 0, first.stderr
    assert files_of(dest) == files_of(tiny_model)
    result = result_of(first)
    total = sum(len(b) for b in files_of(tiny_model).values())
    assert (result["state"], result["bytes"], result["downloaded_bytes"]) == ("complete", total, total)
    # piped: plain progress lines the operator can read, the last one complete
    lines = [ln for ln in first.stderr.splitlines() if ln.startswith("fetch progress ")]
    assert lines and f"bytes={total} total={total} percent=100.0" in lines[-1], first.stderr
    manifest = json.loads((dest / ".dlo-fetch.json").read_text())
    assert any("-" in f["checksum"] for f in manifest["files"].values()), "no multipart object was fetched"
    assert not staging_dir(dest).exists()

    second = dlo_fetch(uri, str(dest), "--endpoint", s3.url, "--json", env=s3.env())
    assert second.returncode == 0, second.stderr
    again = result_of(second)
    assert again["already_complete"] is True and again["downloaded_bytes"] == 0
    assert files_of(dest) == files_of(tiny_model)


def test_multipart_etag_is_checked_over_the_upload_parts(s3, tmp_path, monkeypatch):
    """A multipart object's ETag is the MD5 of its parts' MD5s: the check recomputes it (a whole-file
    MD5 would refuse every multipart object) and still catches one flipped byte."""
    from dlo.delivery.s3 import S3Source
    from dlo.delivery.uri import parse_uri

    data = os.urandom(200 * 1024)  # 4 parts of 64 KiB at most
    local = tmp_path / "src" / "blob.bin"
    local.parent.mkdir()
    local.write_bytes(data)
    upload(s3.client(), local.parent, "parts", "p")
    etag = s3.client().head_object(Bucket="parts", Key="p/blob.bin")["ETag"].strip('"')
    assert etag.endswith("-4") and etag.split("-")[0] != hashlib.md5(data).hexdigest()
    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    source = S3Source(parse_uri("s3://parts/p"), s3.url)
    entry = SourceFile("blob.bin", len(data), etag, "s3-etag")
    assert source.verify(local, entry)
    flipped = bytearray(data)
    flipped[150_000] ^= 1
    local.write_bytes(bytes(flipped))
    assert not source.verify(local, entry)
    assert not source.verify(local, SourceFile("blob.bin", len(data) + 1, etag, "s3-etag"))


def test_a_killed_fetch_resumes_where_it_stopped(s3, tiny_model, tmp_path):
    src = tmp_path / "big"
    shutil.copytree(tiny_model, src)
    (src / "vae" / "extra.safetensors").write_bytes(os.urandom(16 * 2**20))  # long enough to be killed
    upload(s3.client(), src, "models", "resume", part_size=8 * 2**20)
    dest = tmp_path / "dest" / "resume"
    argv = [sys.executable, "-m", "dlo.cli.main", "fetch", "s3://models/resume", str(dest), "--endpoint", s3.url,
            "--part-size", "256KiB", "--concurrency", "1", "--json", "--progress", "none"]
    proc = subprocess.Popen(argv, env=s3.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    state = staging_dir(dest) / STATE

    def bytes_done() -> int:
        try:
            files = json.loads(state.read_text())["files"]
        except (OSError, ValueError, KeyError):
            return 0
        return sum(min(f["part_size"], f["size"] - i * f["part_size"]) for f in files.values() for i in f["done"])

    deadline = time.monotonic() + 60
    while bytes_done() < 2 * 2**20:
        assert proc.poll() is None, "the fetch ended before it could be interrupted"
        assert time.monotonic() < deadline, "no progress in 60 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not dest.exists() and staging_dir(dest).exists()
    done_before = bytes_done()

    rerun = dlo_fetch(*argv[4:], env=s3.env())
    assert rerun.returncode == 0, rerun.stderr
    result = result_of(rerun)
    total = sum(len(b) for b in files_of(src).values())
    assert result["bytes"] == total
    assert result["downloaded_bytes"] <= total - done_before  # what was written is not fetched again
    assert files_of(dest) == files_of(src)


@pytest.mark.parametrize("case", ["no-model-index", "missing-shard"])
def test_a_source_that_is_not_a_pipeline_is_refused_and_nothing_is_left(s3, tiny_model, tmp_path, case):
    src = tmp_path / "src"
    shutil.copytree(tiny_model, src)
    if case == "no-model-index":
        (src / "model_index.json").unlink()
    else:
        index = {"metadata": {}, "weight_map": {"a.weight": "diffusion_pytorch_model-00001-of-00002.safetensors",
                                                "b.weight": "diffusion_pytorch_model-00002-of-00002.safetensors"}}
        (src / "transformer" / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    upload(s3.client(), src, "models", f"broken-{case}")
    dest = tmp_path / "dest" / "model"
    proc = dlo_fetch(f"s3://models/broken-{case}", str(dest), "--endpoint", s3.url, env=s3.env())
    assert proc.returncode == 2, proc.stderr
    assert ("no model_index.json" if case == "no-model-index" else "missing shards") in proc.stderr
    assert not dest.exists() and not staging_dir(dest).exists()
    assert list((tmp_path / "dest").iterdir()) == []


def test_wrong_credentials_are_refused_by_the_server_with_a_clear_error(tiny_model, tmp_path):
    # Authentication on from the fourth request: the IAM user, its key and its policy come first.
    server = start_moto(INITIAL_NO_AUTH_ACTION_COUNT="3")
    try:
        import boto3

        iam = boto3.client("iam", endpoint_url=server.url, region_name="us-east-1", aws_access_key_id="setup",
                           aws_secret_access_key="setup")
        iam.create_user(UserName="fetcher")
        key = iam.create_access_key(UserName="fetcher")["AccessKey"]
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        iam.put_user_policy(UserName="fetcher", PolicyName="s3", PolicyDocument=json.dumps(policy))
        server.access_key, server.secret_key = key["AccessKeyId"], key["SecretAccessKey"]
        upload(server.client(), tiny_model, "private", "tiny-wan")
        dest = tmp_path / "tiny-wan"
        wrong = dlo_fetch("s3://private/tiny-wan", str(dest), "--endpoint", server.url,
                          env=server.env(AWS_SECRET_ACCESS_KEY="not-the-secret"))
        assert wrong.returncode == 1
        assert "auth:" in wrong.stderr and "refused the credentials" in wrong.stderr
        assert "SignatureDoesNotMatch" in wrong.stderr and "AWS_SECRET_ACCESS_KEY" in wrong.stderr
        assert not dest.exists()
        right = dlo_fetch("s3://private/tiny-wan", str(dest), "--endpoint", server.url, env=server.env())
        assert right.returncode == 0, right.stderr
        assert files_of(dest) == files_of(tiny_model)
    finally:
        server.process.terminate()
        server.process.wait(timeout=30)
