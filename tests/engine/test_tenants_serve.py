"""Tenants through a real `dlo serve --api-keys` process and the official openai SDK: each key sees,
fetches and deletes only its own video jobs (another tenant's job is a 404 in the words of one that
does not exist), the admin key sees all; the queue and video-job quotas count per key, not per
address (every client here is 127.0.0.1); the key's name is the metric label and no key ever shows
in /metrics, an answer or the log."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
import requests
from openai import OpenAI

from dlo.plan.limits import SMALL
from dlo.serving.launch import ServerProcess
from tests.engine.serving_helpers import tiny_pipeline, wait_until

pytestmark = pytest.mark.slow

KEYS = {name: f"sk-{name}-{i}f3a9c" for i, name in enumerate(("alice", "bob", "carol", "dave", "ops"))}
LONG_STEPS = 800  # a video job that holds the single rank for a few seconds
VIDEO = {"num_frames": 5, "num_inference_steps": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    (tmp / "keys").write_text("# tenants\n" + "".join(f"{name}: {key}\n" for name, key in KEYS.items()))
    (tmp / "limits.json").write_text(json.dumps({**SMALL.model_dump(), "max_steps": LONG_STEPS}))
    srv = ServerProcess(tiny_pipeline(tmp_path_factory, "wan"), "--dp", "1", "--mode", "rank-local", "--device", "cpu",
                        "--limits", str(tmp / "limits.json"), "--api-keys", str(tmp / "keys"), "--admin-key", "ops",
                        "--max-queue-per-tenant", "1", "--max-video-jobs-per-tenant", "2", "--log-level", "debug",
                        log_path=tmp / "serve.log")
    with srv:
        yield srv


def sdk(server: ServerProcess, name: str) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key=KEYS[name], max_retries=0)


def finished(client: OpenAI, prompt: str, **extra) -> str:
    job = client.videos.create(prompt=prompt, size="64x64", extra_body={**VIDEO, **extra})  # type: ignore[arg-type]
    wait_until(lambda: client.videos.retrieve(job.id).status in ("completed", "failed"), 120, f"{prompt} ended")
    assert client.videos.retrieve(job.id).status == "completed"
    return job.id


def not_found(call, *args) -> dict:
    with pytest.raises(openai.NotFoundError) as refused:
        call(*args)
    return refused.value.body  # type: ignore[return-value]


def test_each_key_sees_only_its_own_video_jobs_and_the_admin_sees_all(server):
    alice, bob, ops = sdk(server, "alice"), sdk(server, "bob"), sdk(server, "ops")
    a, b = finished(alice, "alice's waves"), finished(bob, "bob's tide")
    assert [v.id for v in alice.videos.list().data] == [a] and [v.id for v in bob.videos.list().data] == [b]
    assert {a, b} <= {v.id for v in ops.videos.list(limit=100).data}
    nobody = a[:-4] + ("0000" if not a.endswith("0000") else "1111")
    absent = not_found(bob.videos.retrieve, nobody)
    for call in (bob.videos.retrieve, bob.videos.delete, bob.videos.download_content):
        body = not_found(call, a)
        assert json.dumps(body).replace(a, "ID") == json.dumps(absent).replace(nobody, "ID")  # existence not told
    assert alice.videos.retrieve(a).status == "completed"  # bob's delete did nothing
    assert ops.videos.retrieve(a).prompt == "alice's waves"
    assert ops.videos.delete(b).deleted
    not_found(bob.videos.retrieve, b)


def test_quotas_count_per_key_so_one_tenant_at_its_quota_never_refuses_another(server):
    carol, dave = sdk(server, "carol"), sdk(server, "dave")
    long = carol.videos.create(prompt="carol's long take", size="64x64",  # type: ignore[arg-type]
                               extra_body={**VIDEO, "num_inference_steps": LONG_STEPS})
    wait_until(lambda: carol.videos.retrieve(long.id).status == "in_progress", 60, "carol's long job runs")
    with pytest.raises(openai.RateLimitError) as refused:  # her share of the queue (1) is taken
        carol.images.generate(prompt="one more", size="64x64", extra_body={"num_inference_steps": 1})
    assert refused.value.body["code"] == "tenant_queue_full" and refused.value.response.headers["retry-after"]
    answered: dict[str, object] = {}
    image = threading.Thread(target=lambda: answered.update(r=dave.images.generate(
        prompt="dave's", size="64x64", extra_body={"num_inference_steps": 1})))
    image.start()  # same address, another key: waits behind carol's job (dp 1), is not refused
    wait_until(lambda: requests.get(server.url + "/health", timeout=5).json()["queued"] == 1, 30,
               "dave's image waits in the queue while carol's job runs")
    image.join(180)
    assert answered["r"].data[0].b64_json  # type: ignore[attr-defined]
    wait_until(lambda: carol.videos.retrieve(long.id).status == "completed", 120, "carol's long job completed")
    finished(carol, "carol's second")  # two video jobs: her quota
    with pytest.raises(openai.RateLimitError) as full:
        carol.videos.create(prompt="a third", size="64x64", extra_body=VIDEO)  # type: ignore[arg-type]
    assert full.value.body["code"] == "too_many_video_jobs" and "this tenant holds 2" in full.value.body["message"]
    finished(dave, "dave's first")  # dave's own quota is untouched


def test_the_key_name_labels_the_metrics_and_no_key_shows_anywhere(server):
    job = finished(sdk(server, "alice"), "for the metrics", seed=5)
    assert sdk(server, "ops").videos.retrieve(job).id == job
    assert sdk(server, "bob").images.generate(prompt="timed", size="64x64", extra_body={"num_inference_steps": 1}).data
    bad = requests.post(server.url + "/v1/images/generations", json={"prompt": "x"},
                        headers={"Authorization": f"Bearer {KEYS['alice']}x"}, timeout=30)
    assert bad.status_code == 401
    metrics = server.metrics()
    by_tenant = {(lab["tenant"], lab["endpoint"], lab["code"]) for lab, _ in metrics["dlo_requests_total"]}
    assert ("alice", "/v1/videos", "200") in by_tenant and ("ops", "/v1/videos/{video_id}", "200") in by_tenant
    assert ("", "/v1/images/generations", "401") in by_tenant  # an unknown key is nobody
    assert {t for t, _, _ in by_tenant} <= {"", *KEYS}
    timed = {lab["tenant"] for lab, _ in metrics["dlo_request_duration_seconds_count"]}
    assert "bob" in timed  # images are timed per tenant
    assert server.log_path is not None
    log = server.log_path.read_text()
    assert "DEBUG" in log and "tenants=alice,bob,carol,dave,ops admins=ops" in log
    seen = [server.get(p)[1].decode() for p in ("/metrics", "/health", "/ready")] + [bad.text, log]
    assert not [name for name, key in KEYS.items() for blob in seen if key in blob]
