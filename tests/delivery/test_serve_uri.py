"""`dlo serve URI`: an s3:// model is fetched into the local cache, then served under its own name;
the cache folder holds the verified pipeline; a model a local server serves is never evicted."""

from __future__ import annotations

import json

import pytest

from dlo.delivery.uri import cache_key, parse_uri
from dlo.serving.launch import ServerProcess
from tests.delivery.conftest import dlo_fetch, files_of, result_of, upload

pytestmark = pytest.mark.slow


def test_serve_a_uri_fetches_it_into_the_cache_then_serves_it(s3, tiny_model, tmp_path):
    upload(s3.client(), tiny_model, "models", "serve/tiny-wan")
    uri = "s3://models/serve/tiny-wan"
    env = {**s3.env(), "XDG_CACHE_HOME": str(tmp_path / "xdg"), "AWS_ENDPOINT_URL_S3": s3.url,
           "HF_HUB_OFFLINE": "1"}
    srv = ServerProcess(uri, "--dp", "1", "--mode", "resident", "--device", "cpu", "--small-limits",
                        "--no-warmup", log_path=tmp_path / "serve.log", env=env)
    srv.start(ready_timeout_s=240)
    try:
        status, body = srv.get("/v1/models")
        assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["tiny-wan"]
    finally:
        srv.stop()
    folder = tmp_path / "xdg" / "dlo" / "models" / cache_key(parse_uri(uri), s3.url)
    assert files_of(folder) == files_of(tiny_model)


@pytest.mark.parametrize("started_on", ["uri", "folder"])
def test_a_model_another_local_server_serves_is_never_evicted(s3, tiny_model, tmp_path, started_on):
    """`dlo serve URI` holds its folder's lease; a server started on the folder's path maps its
    files: either way a fetch whose budget needs that room fails in one line and evicts nothing."""
    upload(s3.client(), tiny_model, "models", f"inuse-{started_on}/served")
    upload(s3.client(), tiny_model, "models", f"inuse-{started_on}/next")
    env = {**s3.env(), "XDG_CACHE_HOME": str(tmp_path / "xdg"), "AWS_ENDPOINT_URL_S3": s3.url,
           "HF_HUB_OFFLINE": "1"}
    uri = f"s3://models/inuse-{started_on}/served"
    cache = tmp_path / "xdg" / "dlo" / "models"
    served = cache / cache_key(parse_uri(uri), s3.url)
    if started_on == "folder":
        assert dlo_fetch(uri, str(served), "--endpoint", s3.url, env=env).returncode == 0
    srv = ServerProcess(uri if started_on == "uri" else served, "--dp", "1", "--mode", "resident", "--device", "cpu",
                        "--small-limits", "--no-warmup", log_path=tmp_path / "serve.log", env=env)
    srv.start(ready_timeout_s=240)
    try:
        size = sum(len(b) for b in files_of(tiny_model).values())
        proc = dlo_fetch(f"s3://models/inuse-{started_on}/next", str(cache / "next"), "--endpoint", s3.url,
                         "--disk-budget", str(size + size // 2), "--progress", "none", "--json", env=env)
        assert proc.returncode == 1, proc.stderr
        assert result_of(proc)["reason"] == "disk_budget" and served.name in proc.stderr, proc.stderr
        assert files_of(served) == files_of(tiny_model) and not (cache / "next").exists()
        assert srv.get("/v1/models")[0] == 200
    finally:
        srv.stop()
