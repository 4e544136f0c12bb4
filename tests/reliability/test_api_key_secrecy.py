"""The API key of `dlo serve` (from DLO_API_KEY or --api-key-file) never shows: not in the logs of
any rank (at debug level), not in /metrics, not in any answer, not in /proc/<pid>/cmdline of any
rank, and not in the child ranks' environment (only rank 0 answers HTTP)."""

from __future__ import annotations

import secrets
from pathlib import Path

import psutil
import pytest
import requests

from dlo.serving.launch import ServerProcess
from tests.engine.serving_helpers import tiny_pipeline

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("source", ["env", "file"])
def test_the_api_key_never_leaks(tmp_path_factory, tmp_path, source):
    key = "sk-" + secrets.token_hex(24)
    args = ["--dp", "2", "--mode", "allgather", "--device", "cpu", "--small-limits", "--log-level", "debug"]
    if source == "file":
        (tmp_path / "key").write_text(key + "\n")
        args += ["--api-key-file", str(tmp_path / "key")]
    log = tmp_path / "serve.log"
    srv = ServerProcess(tiny_pipeline(tmp_path_factory, "wan"), *args, api_key=key if source == "env" else None,
                        log_path=log)
    seen: list[bytes] = []
    with srv:
        assert srv.proc is not None
        ranks = [psutil.Process(srv.proc.pid), *psutil.Process(srv.proc.pid).children(recursive=True)]
        assert len(ranks) == 2
        url = srv.url + "/v1/images/generations"
        good = requests.post(url, json={"prompt": "x", "num_inference_steps": 1},
                             headers={"Authorization": f"Bearer {key}"}, timeout=60)
        assert good.status_code == 200
        for wrong in (key[:-1], key + "x", key.upper()):
            r = requests.post(url, json={"prompt": "x"}, headers={"Authorization": f"Bearer {wrong}"}, timeout=60)
            assert r.status_code == 401
            seen.append(r.content)
        r = requests.post(url, json={"prompt": "x", "user": key}, timeout=60)  # the key in a body, no header
        assert r.status_code == 401
        seen += [r.content, srv.get("/metrics")[1], srv.get("/ready")[1], srv.get("/health")[1],
                 srv.get("/openapi.json")[1]]
        for p in ranks:
            seen.append(Path(f"/proc/{p.pid}/cmdline").read_bytes())
        for child in ranks[1:]:
            seen.append(Path(f"/proc/{child.pid}/environ").read_bytes())
    assert srv.proc.returncode == 0
    seen.append(log.read_bytes())
    assert b"DEBUG" in seen[-1], "the server did not log at debug level: the check would prove little"
    leaks = [i for i, blob in enumerate(seen) if key.encode() in blob]
    assert not leaks, f"the API key appeared in {leaks} of {len(seen)} places checked"
