"""serving/server.py's video routes and error shapes against a stub engine (real HTTP, no ranks):
list, delete (409 while unfinished), 404/405 in OpenAI's shape, Retry-After on 429, and forwarding
to the pod a job id names: its answer passed through, 502 when it cannot be reached, 504 when it
does not answer in time, no second hop."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
import uvicorn

from dlo.engine.families import PipelineFacts
from dlo.engine.ports import free_port
from dlo.engine.settings import EngineSettings, OffloadSettings
from dlo.serving.errors import (
    QueueFull,
    VideoElsewhere,
    VideoNotFinished,
    VideoNotFound,
    VideoNotReady,
    VideoStorageError,
)
from dlo.plan.limits import Limits
from dlo.serving.metrics import EngineMetrics
from dlo.serving.peers import Peers
from dlo.serving.server import api_error, create_app, status_of
from dlo.serving.tenants import Tenants
from dlo.serving.videos import VideoJob, VideoStore

KEY = "stub-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass
class StubConfig:
    """What the server reads of the engine's `RankConfig`: the settings (no step cache by default)."""

    settings: EngineSettings = field(default_factory=lambda: EngineSettings(OffloadSettings(mode="resident")))
    mode: str = "resident"
    dp: int = 1
    sp: int = 1


@dataclass
class StubEngine:
    """What the server reads of `service.Engine`, without ranks."""

    videos: VideoStore
    limits: Limits = field(default_factory=Limits)
    model_id: str = "tiny"
    adapters: dict = field(default_factory=dict)  # no --lora-dir
    state: str = "ready"
    failure: str | None = None
    metrics: EngineMetrics = field(default_factory=lambda: EngineMetrics(1, dict))
    queue_full: bool = False
    facts: PipelineFacts = field(default_factory=lambda: PipelineFacts(
        "wan-i2v", "WanImageToVideoPipeline", 16, 4, 5.0, "WanTransformer3DModel", image_input=True))
    cfg: StubConfig = field(default_factory=StubConfig)

    def create(self, gen: object, seconds: str, caller: object = None, held: object = None) -> VideoJob:
        raise QueueFull("the stub queues nothing", retry_after_s=1)  # what follows the request's reading

    def unhealthy_reason(self) -> str | None:
        return None

    def occupancy(self) -> dict[str, int]:
        return {"running": 0, "queued": 0}

    async def startup(self) -> None:
        self.videos.load()

    async def shutdown(self) -> None:
        pass

    def check_available(self) -> None:
        if self.queue_full:
            raise QueueFull("2 requests are waiting (--max-queue 2); retry later", retry_after_s=7)

    @property
    def jobs(self) -> "StubEngine":
        return self  # the stub is its own video-job runner

    def progress(self, job: VideoJob) -> int:
        return 100 if job.status in ("completed", "failed") else 0


class Served:
    """A uvicorn server in a thread; stopped (and waited for) on exit."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "Served":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the stub server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


def _add(store: VideoStore, created_at: int, status: str = "completed") -> VideoJob:
    job = store.add(VideoJob(id=store.new_id(), created_at=created_at, model="tiny", prompt="p", seconds="4.5",
                             size="64x64", steps=2))
    if status == "completed":
        store.write_content(job.id, b"\x00\x00\x00\x18ftypmp42" + job.id.encode())
        store.complete(job.id)
    elif status == "in_progress":
        store.start(job.id, 0)
    return job


def _serve(tmp_path, pod: str, peers: Peers | None = None) -> tuple[Served, StubEngine]:
    engine = StubEngine(VideoStore(tmp_path / pod, ttl_s=600, pod=pod))
    return Served(create_app(engine, Tenants.single(KEY), peers)), engine  # type: ignore[arg-type]


def test_list_pages_and_delete_in_openai_shapes(tmp_path):
    served, engine = _serve(tmp_path, "wan-0")
    with served as srv:
        engine.videos.load()
        jobs = [_add(engine.videos, t) for t in (10, 20, 30)]
        running = _add(engine.videos, 40, "in_progress")
        page = requests.get(srv.url + "/v1/videos", params={"limit": 2}, headers=AUTH).json()
        assert page["object"] == "list" and page["has_more"] is True
        assert [v["id"] for v in page["data"]] == [running.id, jobs[2].id]
        assert page["first_id"] == running.id and page["last_id"] == jobs[2].id
        rest = requests.get(srv.url + "/v1/videos", params={"limit": 2, "after": page["last_id"]}, headers=AUTH).json()
        assert [v["id"] for v in rest["data"]] == [jobs[1].id, jobs[0].id] and rest["has_more"] is False
        asc = requests.get(srv.url + "/v1/videos", params={"order": "asc"}, headers=AUTH).json()
        assert [v["id"] for v in asc["data"]] == [j.id for j in jobs] + [running.id]
        done = asc["data"][0]
        assert done["expires_at"] == done["completed_at"] + 600 and done["object"] == "video"
        for params in ({"limit": 0}, {"limit": 101}, {"order": "sideways"}):
            bad = requests.get(srv.url + "/v1/videos", params=params, headers=AUTH)
            assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", params
        unknown_cursor = requests.get(srv.url + "/v1/videos", params={"after": "video_x"}, headers=AUTH)
        assert unknown_cursor.status_code == 404 and unknown_cursor.json()["error"]["param"] == "after"

        busy = requests.delete(f"{srv.url}/v1/videos/{running.id}", headers=AUTH)
        assert busy.status_code == 409
        assert busy.json()["error"] == {"message": busy.json()["error"]["message"], "type": "invalid_request_error",
                                        "param": None, "code": "video_not_finished"}
        gone = requests.delete(f"{srv.url}/v1/videos/{jobs[0].id}", headers=AUTH)
        assert gone.status_code == 200 and gone.json() == {"id": jobs[0].id, "object": "video.deleted",
                                                           "deleted": True}
        assert not list(engine.videos.folder.glob(f"{jobs[0].id}.*"))
        for method in ("get", "delete"):
            again = requests.request(method, f"{srv.url}/v1/videos/{jobs[0].id}", headers=AUTH)
            assert again.status_code == 404 and again.json()["error"]["code"] == "not_found"
        assert requests.delete(f"{srv.url}/v1/videos/{jobs[1].id}").status_code == 401


def test_unknown_routes_and_wrong_methods_answer_in_openai_shape(tmp_path):
    served, _ = _serve(tmp_path, "wan-0")
    with served as srv:
        for method, path in (("put", "/v1/videos"), ("patch", "/v1/videos/video_x"), ("get", "/v1/images/generations"),
                             ("delete", "/v1/models")):
            r = requests.request(method, srv.url + path, headers=AUTH)
            assert r.status_code == 405, (method, path)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["code"] == "method_not_allowed", err
            assert method.upper() in err["message"] and r.headers["allow"]
        r = requests.get(srv.url + "/v1/nothing-here", headers=AUTH)
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
        assert r.json()["error"]["code"] == "not_found"


def test_a_full_queue_answers_429_with_retry_after(tmp_path):
    served, engine = _serve(tmp_path, "wan-0")
    engine.queue_full = True
    with served as srv:
        r = requests.post(srv.url + "/v1/videos", json={"prompt": "x"}, headers=AUTH)
        assert r.status_code == 429 and r.headers["retry-after"] == "7"
        assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"


def test_requests_for_another_pods_job_are_answered_by_that_pod(tmp_path):
    served_a, a = _serve(tmp_path, "wan-0")
    with served_a as srv_a:
        peers = Peers(urls={"wan-0": srv_a.url})
        served_b, b = _serve(tmp_path, "wan-1", peers)
        with served_b as srv_b:
            job, running = _add(a.videos, 1), _add(a.videos, 2, "in_progress")
            own = _add(b.videos, 3)
            got = requests.get(f"{srv_b.url}/v1/videos/{job.id}", headers=AUTH)
            assert got.status_code == 200 and got.json() == requests.get(f"{srv_a.url}/v1/videos/{job.id}",
                                                                         headers=AUTH).json()
            content = requests.get(f"{srv_b.url}/v1/videos/{job.id}/content", headers=AUTH)
            assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
            assert content.content == a.videos.content_path(job.id).read_bytes()
            # the other pod's answers pass through as they are: errors, and its own authentication
            not_ready = requests.get(f"{srv_b.url}/v1/videos/{running.id}/content", headers=AUTH)
            assert not_ready.status_code == 404 and not_ready.json()["error"]["code"] == "video_not_ready"
            assert requests.delete(f"{srv_b.url}/v1/videos/{running.id}", headers=AUTH).status_code == 409
            assert requests.get(f"{srv_b.url}/v1/videos/{job.id}").status_code == 401  # B checks first
            missing = job.id[:-4] + "0000"
            assert requests.get(f"{srv_b.url}/v1/videos/{missing}", headers=AUTH).status_code == 404
            listed = requests.get(f"{srv_b.url}/v1/videos", headers=AUTH).json()
            assert [v["id"] for v in listed["data"]] == [own.id]  # a list is the answering pod's jobs
            deleted = requests.delete(f"{srv_b.url}/v1/videos/{job.id}", headers=AUTH)
            assert deleted.status_code == 200 and deleted.json()["id"] == job.id and job.id not in a.videos
            # a pod nobody maps is not reached, and a forwarded request is never forwarded again
            stranger = own.id.replace("wan-1", "wan-7")
            assert requests.get(f"{srv_b.url}/v1/videos/{stranger}", headers=AUTH).status_code == 404
            loop = requests.get(f"{srv_b.url}/v1/videos/{running.id}", headers={**AUTH, "X-DLO-Forwarded": "1"})
            assert loop.status_code == 404


def test_a_gone_pod_is_404_an_unreachable_one_502_a_silent_one_504(tmp_path):
    """Another pod's job: gone (unreachable, and the shared folder holds no record of it) is 404
    not_found; unreachable with its unfinished record in the folder is 502; silent is 504."""
    refused_port = free_port()  # nobody listens there
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections, never answers
    try:
        peers = Peers(urls={"wan-1": f"http://127.0.0.1:{refused_port}",
                            "wan-2": f"http://127.0.0.1:{silent.getsockname()[1]}"},
                      connect_timeout_s=1, read_timeout_s=1)
        served, engine = _serve(tmp_path, "wan-0", peers)
        with served as srv:
            job_id = engine.videos.new_id()
            r = requests.get(f"{srv.url}/v1/videos/{job_id.replace('wan-0', 'wan-1')}", headers=AUTH, timeout=30)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
            other = VideoStore(engine.videos.folder, ttl_s=600, pod="wan-1")  # the same (shared) folder
            other.load()
            running = _add(other, 5, "in_progress")
            r = requests.get(f"{srv.url}/v1/videos/{running.id}", headers=AUTH, timeout=30)
            assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unreachable"
            assert r.json()["error"]["type"] == "server_error"
            r = requests.get(f"{srv.url}/v1/videos/{job_id.replace('wan-0', 'wan-2')}/content", headers=AUTH,
                             timeout=30)
            assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    finally:
        silent.close()


def test_a_finished_job_of_another_pod_is_answered_from_the_shared_folder(tmp_path):
    """Its pod is unreachable (scaled in): status and MP4 come from the shared folder, 200; the
    pod's own list does not show it, and a restart of this pod leaves the other pod's records be."""
    peers = Peers(urls={"wan-1": f"http://127.0.0.1:{free_port()}"}, connect_timeout_s=1, read_timeout_s=1)
    served, engine = _serve(tmp_path, "wan-0", peers)
    with served as srv:
        other = VideoStore(engine.videos.folder, ttl_s=600, pod="wan-1")
        other.load()
        done = _add(other, 7)
        running = _add(other, 8, "in_progress")
        r = requests.get(f"{srv.url}/v1/videos/{done.id}", headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "completed" and r.json()["id"] == done.id
        content = requests.get(f"{srv.url}/v1/videos/{done.id}/content", headers=AUTH, timeout=30)
        assert content.status_code == 200 and content.content.endswith(done.id.encode())
        assert requests.get(f"{srv.url}/v1/videos", headers=AUTH).json()["data"] == []
        gone = requests.delete(f"{srv.url}/v1/videos/{done.id}", headers=AUTH, timeout=30)  # from the shared folder
        assert gone.status_code == 200 and not other.folder.joinpath(f"{done.id}.json").exists()
        assert requests.get(f"{srv.url}/v1/videos/{done.id}", headers=AUTH, timeout=30).status_code == 404
        with pytest.raises(VideoNotFound):  # and its own pod no longer lists it
            other.get(done.id)
    again = VideoStore(engine.videos.folder, ttl_s=600, pod="wan-0")
    again.load()  # this pod's restart: the other pod's running job is not "restarted" by it
    assert len(again) == 0
    record = VideoJob.from_sidecar(json.loads((engine.videos.folder / f"{running.id}.json").read_text()))
    assert record.status == "queued" and record.error is None  # unfinished, as its own pod left it


def test_peer_addresses_come_from_the_template_or_the_map():
    assert Peers.from_env({}) is None
    peers = Peers.from_env({"DLO_PEER_URL_TEMPLATE": "http://{pod}.wan-headless.serving.svc:8000",
                            "DLO_PEER_URLS": '{"wan-9": "http://127.0.0.1:9/"}'})
    assert peers is not None
    assert peers.url("wan-1") == "http://wan-1.wan-headless.serving.svc:8000"
    assert peers.url("wan-9") == "http://127.0.0.1:9"
    with pytest.raises(ValueError):
        Peers.from_env({"DLO_PEER_URL_TEMPLATE": "http://wan-headless:8000"})
    with pytest.raises(ValueError):
        Peers.from_env({"DLO_PEER_URLS": "[1]"})
    asyncio.run(peers.close())


@pytest.mark.parametrize("err,status,code", [
    (VideoNotFound("no video job 'x'"), 404, "not_found"),
    (VideoNotReady("video x is queued"), 404, "video_not_ready"),
    (VideoNotReady("video x is failed", failed=True), 400, "video_not_ready"),
    (VideoNotFinished("video x is in_progress"), 409, "video_not_finished"),
    (VideoElsewhere("wan-1", "video_wan-1_x"), 404, "video_elsewhere"),
    (VideoStorageError("the server could not record the video job: disk full"), 500, "storage_error"),
])
def test_the_server_maps_each_video_error_to_one_status(err, status, code):
    api = api_error(err)
    assert (status_of(err), api.status, api.code, api.message) == (status, status, code, err.message)


def test_the_video_store_speaks_no_http():
    import dlo.serving.videos as videos

    text = Path(videos.__file__).read_text()
    assert "ApiError" not in text and "fastapi" not in text.lower() and "aiohttp" not in text


def _multipart(fields: dict[str, str], name: str, data: bytes) -> tuple[bytes, str]:
    b = "testboundary"
    parts = [f"--{b}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n".encode() for k, v in fields.items()]
    parts.append(f"--{b}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"a.png\"\r\n"
                 "Content-Type: image/png\r\n\r\n".encode() + data + f"\r\n--{b}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={b}"


def _black_png(side: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side)).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def test_reference_images_are_decoded_off_the_event_loop_and_capped(tmp_path):
    """Four 4096x4096 black PNGs (48 KB each: a decode of 16.7 M pixels) keep the decoders busy;
    /health, sent after them, is answered before the last of them (on the event loop it would wait
    for every decode). Beyond max_reference_pixels an image is refused from its header."""
    from concurrent.futures import ThreadPoolExecutor

    served, engine = _serve(tmp_path, "wan-0")
    engine.limits = Limits(max_body_bytes=128 * 1024)  # 4096 x 4096 is the default pixel cap
    png = _black_png(4096)
    files = {"input_reference": ("a.png", png, "image/png")}
    body, ctype = _multipart({"prompt": "x", "size": "64x64"}, "input_reference", png)
    request = (f"POST /v1/videos HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: {ctype}\r\n"
               f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
    with served as srv, ThreadPoolExecutor(4) as pool:
        socks = []
        for _ in range(4):  # every byte of the four requests is sent before /health is
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=120)
            s.sendall(request)
            socks.append(s)

        def answer(s: socket.socket) -> tuple[float, bytes]:
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            s.close()
            return time.monotonic(), data

        posts = [pool.submit(answer, s) for s in socks]
        health = requests.get(srv.url + "/health", timeout=120)
        health_done = time.monotonic()
        answers = [f.result() for f in posts]
        assert health.status_code == 200 and all(a.startswith(b"HTTP/1.1 429") for _, a in answers)  # decoded
        assert health_done < max(t for t, _ in answers), "/health waited for every decode"
        engine.limits = Limits(max_body_bytes=128 * 1024, max_reference_pixels=1024 * 1024)
        r = requests.post(srv.url + "/v1/videos", data={"prompt": "x", "size": "64x64"}, files=files,
                          headers=AUTH, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference"
        assert "at most 1048576 pixels" in r.json()["error"]["message"]
