"""The OpenAI-compatible API of `dlo serve`, through the official openai SDK and raw HTTP."""

from __future__ import annotations

import base64
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import openai
import pytest
from openai import OpenAI

from dlo.serving.launch import ServerProcess
from tests.engine.serving_helpers import tiny_pipeline, wait_until

pytestmark = pytest.mark.slow

KEY = "test-key-0123456789"
MODEL = "tiny-wan-float32"
VIDEO_TTL_S = 600
CONTRACT_METRICS = [
    "dlo_engine_info", "dlo_ready", "dlo_requests_total", "dlo_request_duration_seconds", "dlo_queue_depth",
    "dlo_wave_size", "dlo_wave_duration_seconds", "dlo_step_duration_seconds", "dlo_gather_wait_seconds_total",
    "dlo_h2d_bytes_total", "dlo_collective_bytes_total", "dlo_host_pinned_bytes", "dlo_device_slot_bytes",
    "dlo_device_resident_bytes", "dlo_device_memory_peak_bytes", "dlo_requests_running", "dlo_video_jobs",
    "dlo_video_job_duration_seconds",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_pipeline(tmp_path_factory, "wan")
    tmp = tmp_path_factory.mktemp("http")
    srv = ServerProcess(model, "--dp", "1", "--mode", "rank-local", "--device", "cpu", "--small-limits",
                        "--max-queue", "2", "--video-dir", str(tmp / "videos"), "--video-ttl", str(VIDEO_TTL_S),
                        api_key=KEY, log_path=tmp / "serve.log")
    with srv:
        yield srv


@pytest.fixture()
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _post(server, path: str, body, key: str | None = KEY, **kw) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(server.url + path, json=body, headers=headers, timeout=60, **kw)


def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", png[16:24])


def test_images_generate_with_the_sdk_returns_pngs_of_the_requested_size(client):
    r = client.images.generate(model=MODEL, prompt="a red bicycle", n=2, size="32x64", response_format="b64_json",
                               extra_body={"seed": 7, "num_inference_steps": 2, "guidance_scale": 4.0,
                                           "negative_prompt": "blurry"})
    assert len(r.data) == 2 and r.created > 0
    pngs = [base64.b64decode(d.b64_json or "") for d in r.data]
    assert [_png_size(p) for p in pngs] == [(32, 64), (32, 64)]
    assert pngs[0] != pngs[1]


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "response_format": "url"}, "response_format"),
        ({"prompt": "x", "size": "60x64"}, "size"),
        ({"prompt": "x", "size": "256x256"}, "size"),
        ({"prompt": "x", "size": "big"}, "size"),
        ({"prompt": "x", "n": 3}, "n"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "num_inference_steps": 5}, "num_inference_steps"),
        ({"prompt": "x", "guidance_scale": -1}, "guidance_scale"),
        ({"prompt": "x" * 201}, "prompt"),
        ({"prompt": "   "}, "prompt"),
        ({"prompt": "x", "seed": -1}, "seed"),
        ({"prompt": "x", "num_inference_step": 2}, "num_inference_step"),
        ({"n": 1}, "prompt"),
    ],
)
def test_invalid_image_fields_are_400_in_openai_error_shape(server, body, param):
    r = _post(server, "/v1/images/generations", body)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_url_response_format_is_a_clear_400_through_the_sdk(client):
    with pytest.raises(openai.BadRequestError, match="b64_json"):
        client.images.generate(model=MODEL, prompt="x", response_format="url")


def test_unknown_model_is_404(server):
    r = _post(server, "/v1/images/generations", {"prompt": "x", "model": "sora-2"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_malformed_json_is_400(server):
    r = requests.post(server.url + "/v1/images/generations", data=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}", "content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


@pytest.mark.parametrize("key", [None, "wrong", KEY + "x", KEY[:-1]])
def test_wrong_or_missing_key_is_401(server, key):
    r = _post(server, "/v1/images/generations", {"prompt": "x"}, key=key)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert requests.get(server.url + "/v1/models").status_code == 401


def test_health_ready_and_metrics_need_no_key_and_metrics_follow_the_contract(server, client):
    client.images.generate(model=MODEL, prompt="warm", extra_body={"num_inference_steps": 1})
    assert _post(server, "/v1/images/generations", {"prompt": "x"}, key="wrong").status_code == 401  # its own, run alone too
    assert requests.get(server.url + "/health").json()["status"] == "ok"
    assert requests.get(server.url + "/ready").json()["ready"] is True
    m = server.metrics()
    names = {n.removesuffix("_bucket").removesuffix("_count").removesuffix("_sum") for n in m}
    missing = [n for n in CONTRACT_METRICS if n not in names]
    assert not missing, f"contract metrics missing: {missing}"
    info = m["dlo_engine_info"][0][0]
    assert info == {"mode": "rank-local", "dp": "1", "family": "wan", "device": "cpu", "weights_source": info["weights_source"]}
    assert m["dlo_ready"][0][1] == 1
    codes = {(lab["endpoint"], lab["method"], lab["code"]) for lab, _ in m["dlo_requests_total"]}
    assert ("/v1/images/generations", "POST", "200") in codes
    assert ("/v1/images/generations", "POST", "401") in codes  # counted under the route even before routing
    assert ("/health", "GET", "200") in codes
    assert {lab["state"] for lab, _ in m["dlo_video_jobs"]} == {"queued", "in_progress", "completed", "failed"}
    timed = {lab["endpoint"] for lab, _ in m["dlo_request_duration_seconds_count"]}
    assert "/v1/images/generations" in timed and "/v1/videos" not in timed  # a job is timed to its end
    assert m["dlo_step_duration_seconds_count"][0][1] >= 1
    assert {lab["rank"] for lab, _ in m["dlo_h2d_bytes_total"]} == {"0"}
    assert m["dlo_h2d_bytes_total"][0][1] > 0


def test_videos_with_the_sdk_multipart_create_poll_and_download_mp4(client, server):
    video = client.videos.create(prompt="waves", seconds="4", size="64x64",  # type: ignore[arg-type]
                                 extra_body={"seed": 3, "num_inference_steps": 2})
    assert video.status in ("queued", "in_progress", "completed") and video.object == "video"
    assert video.seconds == "4.5"  # 4 s at 2 fps -> 9 frames (4k+1)
    deadline = time.monotonic() + 60
    seen = [video.progress]
    while video.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.05)
        video = client.videos.retrieve(video.id)
        seen.append(video.progress)
    assert video.status == "completed", video.error
    assert seen == sorted(seen) and seen[-1] == 100 and all(0 <= p <= 100 for p in seen), seen
    mp4 = client.videos.download_content(video.id).read()
    assert mp4[4:8] == b"ftyp" and len(mp4) > 500
    assert video.completed_at is not None and video.expires_at == video.completed_at + VIDEO_TTL_S
    m = server.metrics()  # the job is timed from its creation to its completion, and counted by state
    assert m["dlo_video_job_duration_seconds_count"][0][1] >= 1
    assert dict((lab["state"], v) for lab, v in m["dlo_video_jobs"])["completed"] >= 1


def test_videos_list_and_delete_with_the_sdk(client, server):
    video = client.videos.create(prompt="tide", seconds="1", size="64x64",  # type: ignore[arg-type]
                                 extra_body={"seed": 4, "num_inference_steps": 1})
    wait_until(lambda: client.videos.retrieve(video.id).status in ("completed", "failed"), 60, "the video job ended")
    video = client.videos.retrieve(video.id)
    assert video.status == "completed", video.error
    listed = client.videos.list(limit=100)
    assert video.id in [v.id for v in listed.data]
    created = [v.created_at for v in listed.data]
    assert created == sorted(created, reverse=True)  # newest first by default
    folder = Path(server.cmd[server.cmd.index("--video-dir") + 1])
    assert (folder / f"{video.id}.mp4").exists() and (folder / f"{video.id}.json").exists()
    deleted = client.videos.delete(video.id)
    assert deleted.id == video.id and deleted.deleted and deleted.object == "video.deleted"
    assert not list(folder.glob(f"{video.id}.*"))
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)
    assert video.id not in [v.id for v in client.videos.list(limit=100).data]


def test_wrong_method_and_unknown_route_are_invalid_request_errors(server):
    for method, path in (("delete", "/v1/videos"), ("put", "/v1/videos/video_x"), ("get", "/v1/unknown")):
        r = requests.request(method, server.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert r.status_code in (404, 405) and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_video_json_body_and_limits(server):
    r = _post(server, "/v1/videos", {"prompt": "waves", "num_frames": 5, "size": "64x64", "num_inference_steps": 1})
    assert r.status_code == 200 and r.json()["status"] in ("queued", "in_progress", "completed")
    too_long = _post(server, "/v1/videos", {"prompt": "waves", "seconds": "12"})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "seconds"
    bad_frames = _post(server, "/v1/videos", {"prompt": "waves", "num_frames": 4})
    assert bad_frames.status_code == 400 and bad_frames.json()["error"]["param"] == "num_frames"
    upload = requests.post(server.url + "/v1/videos", headers={"Authorization": f"Bearer {KEY}"},
                        data={"prompt": "x"}, files={"input_reference": ("a.png", b"\x89PNG", "image/png")})
    assert upload.status_code == 400
    missing = requests.get(server.url + "/v1/videos/video_nope", headers={"Authorization": f"Bearer {KEY}"})
    assert missing.status_code == 404


def test_full_queue_answers_429_and_every_other_request_succeeds(server):
    body = {"prompt": "flood", "size": "128x128", "num_inference_steps": 4, "n": 2}
    with ThreadPoolExecutor(10) as pool:
        codes = list(pool.map(lambda _: _post(server, "/v1/images/generations", body), range(10)))
    statuses = sorted(r.status_code for r in codes)
    assert 429 in statuses and set(statuses) <= {200, 429}, statuses
    refused = next(r for r in codes if r.status_code == 429)
    err = refused.json()["error"]
    assert err["type"] == "rate_limit_error" and "max-queue" in err["message"]
    assert int(refused.headers["Retry-After"]) >= 1


def test_requests_before_ready_get_503(tmp_path_factory, tmp_path):
    model = tiny_pipeline(tmp_path_factory, "wan")
    srv = ServerProcess(model, "--dp", "2", "--mode", "allgather", "--device", "cpu", "--small-limits",
                        log_path=tmp_path / "serve.log")
    import subprocess

    srv.proc = subprocess.Popen(srv.cmd, env=srv.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        seen_not_ready = False
        while time.monotonic() < deadline:
            try:
                ready = requests.get(srv.url + "/ready", timeout=5)
            except requests.ConnectionError:
                time.sleep(0.05)
                continue
            if ready.status_code == 200:
                break
            r = _post(srv, "/v1/images/generations", {"prompt": "x"}, key=None)
            if r.status_code == 200:
                # it became ready between the two requests: then it must say so, and the loop ends
                assert requests.get(srv.url + "/ready", timeout=5).status_code == 200
                break
            assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
            seen_not_ready = True
            metrics = requests.get(srv.url + "/metrics").text
            # the gauge says not ready unless readiness came in between (then /ready says 200)
            assert metrics.count("dlo_ready 0.0") == 1 or requests.get(srv.url + "/ready", timeout=5).status_code == 200
            time.sleep(0.05)
        assert seen_not_ready, "the server never answered before it was ready"
    finally:
        assert srv.stop() == 0
