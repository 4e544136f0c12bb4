"""`dlo fetch` bounded in time and in what it leaves: a store that trickles bytes fails the fetch as
`timeout` (a stall under --min-rate over --stall-window, or the overall --deadline) and the process
exits at once; the staging folder of a failed fetch into another DEST is reclaimed by a later fetch
into the same cache once its maker is gone, and a folder nobody proves abandoned is kept."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dlo.delivery.cache import STALE_STAGING_S
from dlo.delivery.staging import STATE, staging_dir
from tests.delivery.conftest import dlo_fetch, files_of, upload
from tests.delivery.test_fetch_local_state import _limit_file_size, failed, fetch, upload_too_big

pytestmark = pytest.mark.slow


class _Trickle(BaseHTTPRequestHandler):
    """A proxy in front of moto that sends the bytes of every `.safetensors` object `step` bytes at a
    time, `pause` seconds apart (listing, HEAD and the small JSON files pass at full speed)."""

    upstream = ""
    step, pause = 1, 0.2

    def _forward(self) -> None:
        host = self.upstream.removeprefix("http://")
        conn = http.client.HTTPConnection(host, timeout=30)
        conn.request(self.command, self.path, headers={k: v for k, v in self.headers.items()})
        resp = conn.getresponse()
        body = resp.read()
        self.send_response(resp.status)
        for name, value in resp.getheaders():
            if name.lower() not in ("connection", "transfer-encoding", "server", "date"):
                self.send_header(name, value)
        self.end_headers()
        slow = self.command == "GET" and self.path.split("?")[0].endswith(".safetensors")
        try:
            for i in range(0, len(body), self.step if slow else len(body) or 1):
                self.wfile.write(body[i:i + (self.step if slow else len(body))])
                self.wfile.flush()
                if slow:
                    time.sleep(self.pause)
        except OSError:
            pass  # the fetch gave up on us

    do_GET = do_HEAD = _forward  # noqa: N815 (the library's names)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def trickle(s3) -> Iterator[type[_Trickle]]:
    handler = type("Trickle", (_Trickle,), {"upstream": s3.url})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    yield handler
    server.shutdown()


@pytest.mark.parametrize("bound", ["stall", "deadline"])
def test_a_store_that_trickles_fails_the_fetch_as_timeout_and_the_process_exits(s3, trickle, tiny_model,
                                                                                tmp_path, bound):
    """stall: 5 bytes a second against --min-rate 1KiB over 2 s; deadline: 40 KB a second (above
    the default rate) for a model that would take half a minute, against --deadline 4."""
    upload(s3.client(), tiny_model, "local", f"trickle/{bound}")
    trickle.step, trickle.pause = (1, 0.2) if bound == "stall" else (4096, 0.1)
    flags = ["--min-rate", "1KiB", "--stall-window", "2"] if bound == "stall" else ["--deadline", "4"]
    dest = tmp_path / "cache" / "m"
    started = time.monotonic()
    proc = dlo_fetch(f"s3://local/trickle/{bound}", str(dest), "--endpoint", trickle.url, "--progress", "none",
                     "--result-file", str(tmp_path / "r.json"), *flags, env=s3.env(), timeout=60)
    took = time.monotonic() - started
    line = failed(proc, tmp_path / "r.json", "timeout")
    assert ("less than --min-rate 1024 bytes/s" if bound == "stall" else "deadline of 4 s") in line, line
    assert took < 20, f"the fetch took {took:.1f} s to give up"
    assert not dest.exists() and staging_dir(dest).is_dir()  # kept to resume
    again = fetch(s3, f"trickle/{bound}", dest)  # the store at full speed
    assert again.returncode == 0, again.stderr
    assert files_of(dest) == files_of(tiny_model)


def _failed_fetch(s3, prefix: str, dest: Path, tmp_path: Path) -> Path:
    proc = fetch(s3, prefix, dest, "--result-file", str(tmp_path / "r.json"), preexec_fn=_limit_file_size)
    failed(proc, tmp_path / "r.json", "disk_full")
    assert staging_dir(dest).is_dir()
    return staging_dir(dest)


def _age(folder: Path, seconds: float) -> None:
    stamp = time.time() - seconds
    for path in (folder / STATE, folder):
        if path.exists():
            os.utime(path, (stamp, stamp))


def test_an_abandoned_staging_folder_of_another_dest_is_reclaimed_and_nothing_else(s3, tiny_model, tmp_path):
    upload_too_big(s3, tiny_model, tmp_path, "abandoned")
    cache = tmp_path / "cache"
    old = _failed_fetch(s3, "abandoned/big", cache / "old", tmp_path)
    recent = _failed_fetch(s3, "abandoned/big", cache / "recent", tmp_path)
    _age(old, STALE_STAGING_S + 60)
    foreign = staging_dir(cache / "foreign")
    foreign.mkdir()
    (foreign / "notes.txt").write_text("someone else's")
    _age(foreign, STALE_STAGING_S + 60)
    proc = fetch(s3, "abandoned/tiny", cache / "new", "--json")
    assert proc.returncode == 0, proc.stderr
    assert not old.exists(), "the abandoned staging folder of a DEST never fetched again was not reclaimed"
    assert recent.is_dir() and json.loads((recent / STATE).read_text())["files"]  # recent: may be resumed
    assert (foreign / "notes.txt").read_text() == "someone else's"  # not made by dlo fetch
    assert files_of(cache / "new") == files_of(tiny_model)
