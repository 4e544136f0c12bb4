"""A body that is no JSON object gets one clear 400 on both generation endpoints, naming the JSON
error and where it stopped, or saying that the body must be a JSON object; `param` is null (real
HTTP against the server's app on a stub engine)."""

from __future__ import annotations

import pytest
import requests

from tests.engine.test_video_routes import KEY, _serve

PATHS = ["/v1/images/generations", "/v1/videos"]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    served, _ = _serve(tmp_path_factory.mktemp("bodies"), "p0")
    with served as srv:
        yield srv.url


def _post(url: str, path: str, data: bytes, ctype: str | None = "application/json") -> dict:
    headers = {"Authorization": f"Bearer {KEY}", **({"content-type": ctype} if ctype else {})}
    r = requests.post(url + path, data=data, headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is None and err["code"] == "invalid_json" and err["type"] == "invalid_request_error", err
    return err


@pytest.mark.parametrize("path", PATHS)
def test_malformed_json_names_the_error_and_where(url, path):
    message = _post(url, path, b'{"prompt": "x",, }')["message"]
    assert "Expecting property name enclosed in double quotes" in message and "(char 15)" in message, message


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("body,kind", [(b"[1, 2]", "an array"), (b'"a cat"', "a string"), (b"null", "null")])
def test_json_that_is_not_an_object_says_a_json_object_is_needed(url, path, body, kind):
    message = _post(url, path, body)["message"]
    assert "the request body must be a JSON object" in message, message
    if path == PATHS[0]:
        assert message.endswith(f"got {kind}"), message


def test_a_body_not_sent_as_json_says_so(url):
    message = _post(url, PATHS[0], b'{"prompt": "x"}', "text/plain")["message"]
    assert message == ("the request body must be a JSON object sent with Content-Type: application/json "
                       "(got Content-Type: text/plain)")
    assert "is empty" in _post(url, PATHS[0], b"")["message"]
