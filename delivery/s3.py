"""S3 (and S3-compatible stores) through boto3: list a prefix, download its objects with ranged,
parallel GETs into the staging folder, verify each file's size and ETag.

Owns: `S3Source`. Parts are `part_size` byte ranges fetched by `concurrency` threads, each GET
conditional on the listed ETag (an object replaced mid-fetch fails as `source_changed` instead of
mixing versions) and written in place (`os.pwrite`); the staging state records each finished part,
so a killed fetch resumes. Verification re-reads the file: a single-part object's ETag is the MD5
of its bytes; a multipart object's (`<hex>-N`) is the MD5 of its N parts' MD5s, so the file is
hashed in the part sizes of the upload (read from HeadObject with PartNumber); an ETag claiming
more parts than S3 allows (or than the object has bytes) is refused before any HEAD.
Each part is read as its bytes arrive and stops between reads when the fetch's `Guard` says so (a
failed part, a stall, the deadline); its threads are the Guard's daemons.
Must never: read credentials itself (boto3's chain reads AWS_* from the environment), or call a
file complete before its checksum matched.
"""

from __future__ import annotations

import hashlib
import math
import os
from functools import partial
from pathlib import Path
from typing import Any

from dlo.delivery.deadline import Guard
from dlo.delivery.errors import FetchError
from dlo.delivery.pipeline import SourceFile
from dlo.delivery.progress import Progress
from dlo.delivery.staging import Staging
from dlo.delivery.uri import ModelURI

DEFAULT_PART_SIZE = 16 * 2**20
DEFAULT_CONCURRENCY = 8
_CHUNK = 1 << 20
_AUTH_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken", "InvalidToken",
               "403", "401"}
_MISSING_CODES = {"NoSuchBucket", "NoSuchKey", "404"}
MAX_PARTS = 10_000  # S3's limit on a multipart upload


READ_TIMEOUT_S = 60  # one read of a store's answer; the whole transfer is bounded by the fetch's Guard


def _client(endpoint: str | None, concurrency: int) -> Any:
    import boto3
    from botocore.config import Config

    session = boto3.session.Session()
    config = Config(retries={"max_attempts": 5, "mode": "standard"}, max_pool_connections=concurrency + 2,
                    connect_timeout=READ_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                    signature_version="s3v4", s3={"addressing_style": "path" if endpoint else "auto"})
    return session.client("s3", endpoint_url=endpoint, region_name=session.region_name or "us-east-1",
                          config=config)


def translate(e: Exception, where: str) -> FetchError:
    """A boto3/botocore error as a FetchError whose reason and message say what to do."""
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

    if isinstance(e, NoCredentialsError):
        return FetchError("auth", f"{where}: no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                          "(in Kubernetes: a Secret named in spec.model.secretRef)")
    if isinstance(e, ClientError):
        code = str(e.response.get("Error", {}).get("Code", ""))
        message = e.response.get("Error", {}).get("Message", "") or str(e)
        if code in _AUTH_CODES:
            return FetchError("auth", f"{where}: the store refused the credentials ({code}: {message}); check "
                              "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket policy")
        if code in _MISSING_CODES:
            return FetchError("not_found", f"{where}: {code}: {message}")
        if code in ("PreconditionFailed", "412"):
            return FetchError("source_changed", f"{where}: an object changed during the fetch (ETag no longer "
                              "matches); fetch again, or put the new model under a new prefix")
        return FetchError("transfer", f"{where}: {code}: {message}")
    if isinstance(e, BotoCoreError):
        return FetchError("transfer", f"{where}: {e}")
    raise e


class S3Source:
    """One `s3://bucket/prefix` model."""

    def __init__(self, uri: ModelURI, endpoint: str | None = None, concurrency: int = DEFAULT_CONCURRENCY,
                 part_size: int = DEFAULT_PART_SIZE, guard: Guard | None = None) -> None:
        self.uri, self.endpoint = uri, endpoint
        self.concurrency, self.part_size = concurrency, part_size
        self.guard = guard or Guard(float("inf"), 0, float("inf"), lambda: 0)
        self.client = _client(endpoint, concurrency)

    def describe(self) -> dict[str, Any]:
        return {"uri": str(self.uri), "endpoint": self.endpoint, "revision": None}

    def listing(self) -> list[SourceFile]:
        """Every object under the prefix (directory markers left out), with size and ETag."""
        prefix = f"{self.uri.path}/" if self.uri.path else ""
        out = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.uri.bucket, Prefix=prefix)
            for page in pages:
                for obj in page.get("Contents", []):
                    rel = obj["Key"][len(prefix):]
                    if rel and not rel.endswith("/"):
                        out.append(SourceFile(rel, int(obj["Size"]), obj["ETag"].strip('"'), "s3-etag"))
        except Exception as e:  # noqa: BLE001 (translate re-raises what is not boto's)
            raise translate(e, str(self.uri)) from None
        if not out:
            raise FetchError("not_found", f"{self.uri}: no objects under this prefix")
        return sorted(out, key=lambda f: f.path)

    def download(self, staging: Staging, files: list[SourceFile], progress: Progress) -> None:
        """Every part of `files` not written yet, `concurrency` at a time; then each file verified
        (a file that fails its check is written again once, then the fetch fails)."""
        todo = [(f, i) for f in files if not staging.verified(f)
                for i in sorted(set(range(self._parts(f))) - staging.begin(f, self.part_size))]
        self._run(staging, todo, progress)
        for f in files:
            if staging.verified(f):
                continue
            if not self.verify(staging.path(f.path), f):
                staging.restart(f)
                progress.rewind(f.size)
                staging.begin(f, self.part_size)
                self._run(staging, [(f, i) for i in range(self._parts(f))], progress)
                if not self.verify(staging.path(f.path), f):
                    raise FetchError("verify", f"{self.uri}/{f.path}: the downloaded bytes do not match the object's "
                                     f"ETag {f.checksum} twice; the store or the disk corrupts data")
            staging.mark_verified(f)
            progress.file_done()

    def _parts(self, f: SourceFile) -> int:
        return max(1, math.ceil(f.size / self.part_size))

    def _run(self, staging: Staging, todo: list[tuple[SourceFile, int]], progress: Progress) -> None:
        """The parts `todo`, `concurrency` at a time under the fetch's Guard (a failure, a stall or the
        deadline stops the others at their next read; the state keeps what finished)."""
        try:
            self.guard.parallel([partial(self._part, staging, f, i, progress) for f, i in todo], self.concurrency)
        finally:
            staging.flush(force=True)

    def _part(self, staging: Staging, f: SourceFile, index: int, progress: Progress, stop: Any) -> None:
        if stop.is_set():
            return
        start = index * self.part_size
        end = min(f.size, start + self.part_size) - 1
        path = staging.path(f.path)
        fd = os.open(path, os.O_WRONLY)
        try:
            if f.size:
                key = f"{self.uri.path}/{f.path}" if self.uri.path else f.path
                try:
                    body = self.client.get_object(Bucket=self.uri.bucket, Key=key, Range=f"bytes={start}-{end}",
                                                  IfMatch=f'"{f.checksum}"')["Body"]
                    offset = start
                    for chunk in _chunks(body):
                        if stop.is_set():
                            return  # another part failed, or the fetch stalled or ran out of time
                        os.pwrite(fd, chunk, offset)
                        offset += len(chunk)
                        progress.advance(len(chunk))
                except Exception as e:  # noqa: BLE001
                    raise translate(e, f"{self.uri}/{f.path}") from None
                finally:
                    body.close()
                if offset != end + 1:
                    raise FetchError("transfer", f"{self.uri}/{f.path}: bytes {start}-{end}: the store sent "
                                     f"{offset - start} bytes")
        finally:
            os.close(fd)
        staging.part_done(f, index)

    def verify(self, path: Path, f: SourceFile) -> bool:
        """True when `path` has the object's size and its ETag (single-part or multipart)."""
        if path.stat().st_size != f.size:
            return False
        digest, _, parts = f.checksum.partition("-")
        if not parts:
            return _md5(path, [f.size]) == [digest]
        sizes = self._upload_part_sizes(f, self._part_count(f, parts))
        joined = b"".join(bytes.fromhex(h) for h in _md5(path, sizes))
        return hashlib.md5(joined, usedforsecurity=False).hexdigest() == digest

    def _part_count(self, f: SourceFile, parts: str) -> int:
        """The part count of a multipart ETag, refused unless S3 could have made it (1 to MAX_PARTS
        parts, none empty): a store that claims more would be asked one HEAD per claimed part."""
        count = int(parts) if parts.isdecimal() and len(parts) <= 9 else 0
        if not 1 <= count <= min(MAX_PARTS, max(f.size, 1)):
            raise FetchError("verify", f"{self.uri}/{f.path}: its ETag {f.checksum[:64]!r} claims {parts[:12]} parts; "
                             f"an S3 object of {f.size} bytes has 1 to {min(MAX_PARTS, max(f.size, 1))}: the store "
                             "is not S3-compatible or lies")
        return count

    def _upload_part_sizes(self, f: SourceFile, count: int) -> list[int]:
        """The part sizes the object was uploaded in: the first part's size (HeadObject PartNumber=1)
        for all but the last, unless that does not add up to `count` parts (then each is asked)."""
        key = f"{self.uri.path}/{f.path}" if self.uri.path else f.path
        try:
            first = int(self.client.head_object(Bucket=self.uri.bucket, Key=key, PartNumber=1)["ContentLength"])
            if first > 0 and math.ceil(f.size / first) == count:
                return [first] * (count - 1) + [f.size - first * (count - 1)]
            return [int(self.client.head_object(Bucket=self.uri.bucket, Key=key, PartNumber=n)["ContentLength"])
                    for n in range(1, count + 1)]
        except Exception as e:  # noqa: BLE001
            raise translate(e, f"{self.uri}/{f.path}") from None


def _chunks(body: Any) -> Any:
    """An object's bytes as they arrive (each read returns what the socket has, up to `_CHUNK`), so a
    store that trickles is seen between reads rather than after a whole chunk."""
    raw = getattr(body, "_raw_stream", None)
    if raw is None or not hasattr(raw, "read1"):
        yield from body.iter_chunks(_CHUNK)
        return
    while chunk := raw.read1(_CHUNK):
        yield chunk


def _md5(path: Path, sizes: list[int]) -> list[str]:
    """The MD5 of each consecutive range of `path` of the given sizes."""
    out = []
    with open(path, "rb") as fh:
        for size in sizes:
            h = hashlib.md5(usedforsecurity=False)
            left = size
            while left > 0:
                chunk = fh.read(min(_CHUNK * 8, left))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk)
            out.append(h.hexdigest())
    return out
