"""Over a thousand generated and malformed requests against the server's own OpenAPI schema: no 5xx.

Schemathesis reads /openapi.json from a real `dlo serve` (small limits, real ranks) and sends
positive and negative cases (wrong types, missing fields, out-of-range values, both JSON and
multipart bodies for /v1/videos) over real HTTP. The limits keep valid cases cheap (32x32, one
step), so most of the budget goes to the POST bodies, where hostile input lands.
"""

from __future__ import annotations

import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from dlo.serving.launch import ServerProcess
from tests.engine.serving_helpers import tiny_pipeline
from tests.reliability.figures import record

pytestmark = pytest.mark.slow

EXAMPLES_PER_POST = 200  # 3 POST strategies (images, videos as JSON and as multipart) x 2 modes = 1,200
EXAMPLES_PER_GET = 60
MIN_CASES_PER_MODE = 500  # >= 1,000 in all
TINY_LIMITS = {"max_width": 32, "max_height": 32, "max_steps": 1, "default_steps": 1, "max_n": 1, "max_frames": 5,
               "max_prompt_chars": 64, "max_sequence_length": 8, "video_fps": 1, "default_size": "32x32",
               "default_video_size": "32x32"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_pipeline(tmp_path_factory, "wan")
    tmp = tmp_path_factory.mktemp("fuzz")
    (tmp / "limits.json").write_text(json.dumps(TINY_LIMITS))
    srv = ServerProcess(model, "--dp", "1", "--mode", "rank-local", "--device", "cpu", "--limits",
                        str(tmp / "limits.json"), "--max-queue", "8", log_path=tmp / "serve.log")
    with srv:
        yield srv
    assert srv.proc is not None and srv.proc.returncode == 0, "the server did not survive the fuzzing"


def _operations(server) -> list:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.NEGATIVE, schemathesis.GenerationMode.POSITIVE])
def test_no_request_gets_a_5xx(server, mode):
    operations = _operations(server)
    assert {op.path for op in operations} >= {"/v1/images/generations", "/v1/videos", "/v1/videos/{video_id}"}
    sent = {"n": 0}
    for op in operations:
        if mode == schemathesis.GenerationMode.NEGATIVE and op.method.upper() != "POST":
            continue  # nothing to break: GET routes take free-form strings or no input at all
        media_types = [None]
        if op.method.upper() == "POST" and op.path == "/v1/videos":
            media_types = ["application/json", "multipart/form-data"]
        for media_type in media_types:
            kwargs = {"media_type": media_type} if media_type else {}
            examples = EXAMPLES_PER_POST if op.method.upper() == "POST" else EXAMPLES_PER_GET

            @given(case=op.as_strategy(mode, **kwargs))
            @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck),
                      database=None)
            def check(case) -> None:
                response = case.call(timeout=60)
                sent["n"] += 1
                detail = f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text[:300]}"
                assert response.status_code < 500, detail
                if response.status_code >= 400:
                    error = response.json()["error"]
                    assert error["message"] and error["type"], detail

            check()
    record("http_fuzz", mode=mode.name, cases=sent["n"])
    assert sent["n"] >= MIN_CASES_PER_MODE, f"only {sent['n']} requests were generated"
