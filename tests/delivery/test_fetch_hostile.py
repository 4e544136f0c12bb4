"""A hostile store against `dlo fetch`: object keys (and Hugging Face paths) that would leave DEST,
alias another file or overwrite the fetch's own files are refused in one line before anything is
written (a published model beside DEST untouched), and an ETag claiming absurdly many parts is
refused before a HEAD per claimed part."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dlo.delivery.paths import UnsafeName, path_under
from dlo.delivery.staging import staging_dir
from tests.delivery.conftest import dlo_fetch, files_of, upload

pytestmark = pytest.mark.slow

# name -> the key below the model's prefix ({outside}: an absolute path outside the cache)
HOSTILE = {
    "dotdot-into-sibling": "../other/transformer/config.json",
    "dotdot-above-cache": "../../escaped.txt",
    "absolute": "{outside}/absolute.txt",
    "backslash": "vae\\..\\..\\escaped.txt",
    "dot-alias": "transformer/./config.json",
    "empty-segment": "vae//escaped.txt",
    "nul": "vae/nul\x00.txt",
    "own-manifest": ".dlo-fetch.json",
    "case-alias": "Transformer/config.json",
}


def tree(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `root`: its mtime (ns) and bytes, by path."""
    return {str(p): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file()}


def one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_object_key_is_refused_and_nothing_is_written_outside_dest(s3, tiny_model, tmp_path, case):
    client = s3.client()
    upload(client, tiny_model, "hostile", "clean/other")
    cache = tmp_path / "cache"
    sibling = cache / "other"
    assert dlo_fetch("s3://hostile/clean/other", str(sibling), "--endpoint", s3.url, env=s3.env()).returncode == 0
    outside = tmp_path / "outside"
    outside.mkdir()
    prefix = f"bad/{case}"
    upload(client, tiny_model, "hostile", prefix)
    rel = HOSTILE[case].format(outside=outside)
    client.put_object(Bucket="hostile", Key=f"{prefix}/{rel}", Body=b"poisoned by the store")
    before = tree(tmp_path)

    dest = cache / "model"
    result_file = tmp_path / "result.json"
    proc = dlo_fetch(f"s3://hostile/{prefix}", str(dest), "--endpoint", s3.url, "--progress", "none",
                     "--result-file", str(result_file), env=s3.env())
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc.stderr)
    assert line.startswith("dlo fetch: refused: ") and repr(rel) in line, line
    result = json.loads(result_file.read_text())
    assert (result["state"], result["reason"]) == ("failed", "refused")
    assert not dest.exists() and not staging_dir(dest).exists()
    after = {p: v for p, v in tree(tmp_path).items() if p != str(result_file) and not p.endswith(".model.lock")}
    assert after == before  # nothing outside DEST created, truncated or written (the sibling included)
    assert files_of(sibling) == files_of(tiny_model)


@pytest.mark.parametrize("name", ["", "/etc/passwd", "a/../b", "..", "a/./b", "a//b", "a/", "a\\b", "a\x00b",
                                  "a\nb", ".dlo-state.json", "x/.dlo-served", "a" * 256])
def test_path_under_refuses_every_unsafe_name(tmp_path, name):
    with pytest.raises(UnsafeName, match="nothing was written"):
        path_under(tmp_path, name)


def test_path_under_maps_a_name_once_and_refuses_its_aliases(tmp_path):
    mapped: dict[str, str] = {}
    assert path_under(tmp_path, "vae/config.json", mapped) == tmp_path / "vae" / "config.json"
    assert path_under(tmp_path, "vae/config.json", mapped) == tmp_path / "vae" / "config.json"
    for alias, why in [("VAE/config.json", "same file"), ("vae", "needs a folder"),
                       ("vae/config.json/x", "to be a folder"), ("vae/conf\u0069g.json".upper(), "same file")]:
        with pytest.raises(UnsafeName, match=why):
            path_under(tmp_path, alias, mapped)
    decomposed, composed = "vae/cafe\u0301.txt", "vae/caf\u00e9.txt"
    path_under(tmp_path, decomposed, mapped)
    with pytest.raises(UnsafeName, match="same file"):
        path_under(tmp_path, composed, mapped)


class _Mirror(BaseHTTPRequestHandler):
    """A Hugging Face mirror whose repo lists a path that leaves the folder; it serves nothing else."""

    requests: list[str] = []
    siblings: list[dict] = []

    def do_GET(self) -> None:  # noqa: N802 (the library's name)
        type(self).requests.append(self.path)
        if self.path.startswith("/api/models/"):
            body = json.dumps({"id": "org/tiny", "sha": "0" * 40, "siblings": self.siblings}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
        else:
            body = b"{}"
            self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def hostile_mirror(tiny_model) -> Iterator[str]:
    siblings = []
    for path in sorted(p for p in tiny_model.rglob("*") if p.is_file()):
        data = path.read_bytes()
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        siblings.append({"rfilename": path.relative_to(tiny_model).as_posix(), "size": len(data), "blobId": blob})
    siblings.append({"rfilename": "../../escaped.txt", "size": 3, "blobId": "0" * 40})
    _Mirror.siblings, _Mirror.requests = siblings, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Mirror)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_hugging_face_path_that_leaves_dest_is_refused_before_any_download(hostile_mirror, tmp_path):
    dest = tmp_path / "cache" / "tiny"
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "DLO_LOG_LEVEL": "WARNING"}
    proc = dlo_fetch("hf://org/tiny", str(dest), "--endpoint", hostile_mirror, "--progress", "none", env=env)
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc.stderr)
    assert line.startswith("dlo fetch: refused: ") and "'../../escaped.txt'" in line, line
    assert all(r.startswith("/api/models/") for r in _Mirror.requests), _Mirror.requests  # no file asked for
    assert not dest.exists() and not staging_dir(dest).exists()


def test_an_etag_claiming_absurdly_many_parts_is_refused_before_a_head_per_part(s3, tmp_path, monkeypatch):
    """A hostile store's ETag `<md5>-200000` with every part HEAD answered: refused from the count
    alone (S3 allows 10,000 parts), not after 200,000 requests."""
    from dlo.delivery.errors import FetchError
    from dlo.delivery.pipeline import SourceFile
    from dlo.delivery.s3 import S3Source
    from dlo.delivery.uri import parse_uri

    for name, value in s3.env().items():
        monkeypatch.setenv(name, value)
    local = tmp_path / "blob.bin"
    local.write_bytes(b"x" * 300_000)
    source = S3Source(parse_uri("s3://parts/p"), s3.url)
    heads: list[int] = []

    def head_object(**kwargs: object) -> dict:
        heads.append(int(kwargs.get("PartNumber") or 0))  # type: ignore[call-overload]
        return {"ContentLength": 1}

    monkeypatch.setattr(source.client, "head_object", head_object)
    with pytest.raises(FetchError, match="200000 parts") as refused:
        source.verify(local, SourceFile("blob.bin", 300_000, "0" * 32 + "-200000", "s3-etag"))
    assert refused.value.reason == "verify" and len(heads) <= 1
