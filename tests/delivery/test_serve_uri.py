"""`dlo serve URI`: an s3:// model is fetched into the local cache, then served under its own name;
the cache folder holds the verified pipeline."""

from __future__ import annotations

import json

import pytest

from dlo.delivery.uri import cache_key, parse_uri
from dlo.serving.launch import ServerProcess
from tests.delivery.conftest import files_of, upload

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
