"""Fixtures of the delivery tests: moto's S3 server on loopback (its own process, the real boto3
client against it), a tiny diffusers pipeline to upload, and `dlo fetch` run as a command."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.engine.serving_helpers import tiny_pipeline

# Multipart uploads with small parts, so a 1 MB model has multipart objects (S3's floor is 5 MiB).
PART_MIN = 64 * 1024


@dataclass
class S3Server:
    url: str
    process: subprocess.Popen
    access_key: str = "testing-key"
    secret_key: str = "testing-secret"

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_REGION": "us-east-1", "DLO_LOG_LEVEL": "WARNING", **extra}

    def client(self, secret: str | None = None):
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", aws_access_key_id=self.access_key,
                            aws_secret_access_key=secret or self.secret_key)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(**env: str) -> S3Server:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, "S3_UPLOAD_PART_MIN_SIZE": str(PART_MIN), **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/moto-api/data.json", timeout=2).read()
            return S3Server(url, proc)
        except OSError:
            assert proc.poll() is None, "moto's server exited at start"
            assert time.monotonic() < deadline, "moto's server did not answer within 60 s"
            time.sleep(0.1)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    server = start_moto()
    yield server
    server.process.terminate()
    server.process.wait(timeout=30)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_pipeline(tmp_path_factory)


def upload(client, folder: Path, bucket: str, prefix: str, part_size: int = PART_MIN) -> None:
    """Every file under `folder` to `s3://bucket/prefix/`; a file over `part_size` as a multipart
    object of `part_size` parts (by hand: boto3's transfer manager never cuts below 5 MiB)."""
    existing = {b["Name"] for b in client.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        client.create_bucket(Bucket=bucket)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        key = f"{prefix}/{path.relative_to(folder).as_posix()}"
        data = path.read_bytes()
        if len(data) <= part_size:
            client.put_object(Bucket=bucket, Key=key, Body=data)
            continue
        upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        parts = []
        for n, start in enumerate(range(0, len(data), part_size), 1):
            etag = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=n,
                                      Body=data[start:start + part_size])["ETag"]
            parts.append({"PartNumber": n, "ETag": etag})
        client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id,
                                         MultipartUpload={"Parts": parts})


def dlo_fetch(*argv: str, env: dict[str, str], timeout: float = 120, **popen: object) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dlo.cli.main", "fetch", *argv], env=env, capture_output=True,
                          text=True, timeout=timeout, **popen)  # type: ignore[call-overload]


def result_of(proc: subprocess.CompletedProcess) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


def files_of(folder: Path) -> dict[str, bytes]:
    """Every file's bytes by relative path, the fetch's own manifest and stamps left out."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and not p.name.startswith(".dlo-")}
