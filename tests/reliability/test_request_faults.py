"""Fault isolation by phase: a request that fails outside the collective schedule fails alone.

One server per (mode, dp), with the test-only fault hook (`dlo.serving.faults`) armed for
several phases at once, each matched by its own prompt. For every phase a faulty request runs in
the same wave as a good one (dp 2; the faulty request lands on rank 0 or rank 1 in turn) or just
before it (dp 1): the faulty request gets OpenAI's error JSON (500, naming the phase), the good
one its 200 with the same bytes as the same request alone, and the engine serves on. A lone
UTF-16 surrogate in a prompt is a 400 before anything is queued.
"""

from __future__ import annotations

import base64

import pytest
import requests

from dlo.serving.faults import FAULTS_ENV, HOOKS_ENV
from dlo.serving.launch import ServerProcess
from tests.engine.serving_helpers import sha, submit_in_order, tiny_pipeline, wait_until
from tests.reliability.figures import record

pytestmark = pytest.mark.slow

IMAGES = "/v1/images/generations"
GOOD = {"prompt": "a lighthouse", "size": "32x32", "num_inference_steps": 2, "seed": 11}
# pipeline phases with the words each failed request's message carries
PHASES = {"encode": "prepare", "setup": "prepare", "step": "denoise", "decode": "decode", "png": "encode_output"}
FAULTS = ",".join([f"{p}:*:boom-{p}" for p in [*PHASES, "mp4"]] + ["validation:0:boom-validation"])
CONFIGS = [("allgather", 2), ("rank-local", 2), ("resident", 1), ("allgather", 1), ("rank-local", 1),
           ("resident", 2)]


def _post(srv: ServerProcess, body: dict, path: str = IMAGES) -> requests.Response:
    return requests.post(srv.url + path, json=body, timeout=120)


def _png(r: requests.Response) -> bytes:
    assert r.status_code == 200, r.text[:300]
    return base64.b64decode(r.json()["data"][0]["b64_json"])


def _waves(srv: ServerProcess) -> tuple[float, float]:
    m = srv.metrics()
    return m["dlo_wave_size_count"][0][1], m["dlo_wave_size_sum"][0][1]


def _video(srv: ServerProcess, prompt: str) -> dict:
    r = _post(srv, {"prompt": prompt, "size": "32x32", "num_frames": 5, "num_inference_steps": 2, "seed": 3},
              "/v1/videos")
    assert r.status_code == 200, r.text[:300]
    url = f"{srv.url}/v1/videos/{r.json()['id']}"
    wait_until(lambda: requests.get(url, timeout=30).json()["status"] in ("completed", "failed"), 120,
               "the video job ended")
    return requests.get(url, timeout=30).json()


@pytest.mark.parametrize("mode,dp", CONFIGS, ids=[f"{m}-dp{d}" for m, d in CONFIGS])
def test_a_request_failing_in_any_phase_fails_alone(tmp_path_factory, tmp_path, mode, dp):
    model = tiny_pipeline(tmp_path_factory, "wan")
    # A pair is a full wave at dp 2 and starts at once; the window only has to outlast the pair's
    # arrival on a loaded machine (the second is sent once the server holds the first: well under a
    # second); a lone request at dp 2 waits it out, five times per server.
    srv = ServerProcess(model, "--dp", str(dp), "--mode", mode, "--device", "cpu", "--small-limits",
                        "--wave-window-ms", "1500", log_path=tmp_path / "serve.log",
                        env={HOOKS_ENV: "1", FAULTS_ENV: FAULTS})
    with srv:
        ref = _png(_post(srv, GOOD))  # the good request alone, before any fault
        lost = 0
        for i, (phase, words) in enumerate(PHASES.items()):
            bad = {**GOOD, "prompt": f"boom-{phase}", "seed": 100 + i}
            calls = [lambda: _post(srv, bad), lambda: _post(srv, GOOD)]
            if dp > 1 and i % 2:
                calls.reverse()  # the faulty request on rank 1 this time
            waves0 = _waves(srv)
            results = submit_in_order(srv.url, calls)
            r_bad, r_good = results if not (dp > 1 and i % 2) else results[::-1]
            assert r_bad.status_code == 500, (phase, r_bad.status_code, r_bad.text[:300])
            err = r_bad.json()["error"]
            assert err["code"] == "generation_failed" and err["type"] == "server_error", err
            assert words in err["message"] and f"phase={phase}" in err["message"], err
            good_ok = r_good.status_code == 200 and _png(r_good) == ref
            lost += not good_ok
            assert good_ok, f"{phase}: the good request of the same wave got {r_good.status_code} or other bytes"
            if dp > 1:
                waves1 = _waves(srv)
                assert (waves1[0] - waves0[0], waves1[1] - waves0[1]) == (1, 2), \
                    f"{phase}: the two requests did not share one wave ({waves0} -> {waves1})"
            record("request_fault", mode=mode, dp=dp, phase=phase, faulty_status=r_bad.status_code,
                   same_wave_requests=dp, requests_lost=int(not good_ok))

        # a fault while validating on rank 0: OpenAI's JSON, never plain text
        r = _post(srv, {**GOOD, "prompt": "boom-validation"})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text[:300]
        record("request_fault", mode=mode, dp=dp, phase="validation", faulty_status=r.status_code,
               same_wave_requests=0, requests_lost=0)

        # the lone-surrogate prompt that stopped the engine: a 400 before it is queued
        for path, body in [(IMAGES, {"prompt": "\ud800"}), (IMAGES, {"prompt": "x", "negative_prompt": "a\udfff"}),
                           ("/v1/videos", {"prompt": "\ud800"}), ("/v1/videos", {"prompt": "x", "negative_prompt": "\ud800"})]:
            r = _post(srv, body, path)
            assert r.status_code == 400, (path, body, r.status_code, r.text[:300])
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and "surrogate" in err["message"], err
        assert srv.metrics()["dlo_queue_depth"][0][1] == 0

        # a video whose MP4 encoding fails is a failed job; the next video completes
        failed = _video(srv, "boom-mp4")
        assert failed["status"] == "failed" and failed["error"]["code"] == "generation_failed", failed
        assert _video(srv, "a quiet sea")["status"] == "completed"
        record("request_fault", mode=mode, dp=dp, phase="mp4", faulty_status="failed job", same_wave_requests=1,
               requests_lost=0)

        # later requests: same bytes, the engine healthy and ready, every rank still there
        assert _png(_post(srv, GOOD)) == ref, "a request after the faults got other bytes"
        assert srv.get("/health")[0] == 200 and srv.get("/ready")[0] == 200
        assert srv.proc is not None and srv.proc.poll() is None
    assert srv.proc.returncode == 0
    assert lost == 0
    print(f"{mode} dp{dp}: {len(PHASES) + 2} faults injected, reference {sha(ref)}, requests lost {lost}")


def test_a_fault_inside_a_transformer_forward_restarts_the_engine(tmp_path_factory, tmp_path):
    """A forward stopped between offloaded blocks leaves gathers in flight: the gather order cannot
    be trusted, so the wave fails (503 engine_failed for both requests) and the server exits
    non-zero for the pod to restart, as for a dead rank."""
    model = tiny_pipeline(tmp_path_factory, "wan")
    srv = ServerProcess(model, "--dp", "2", "--mode", "allgather", "--device", "cpu", "--small-limits",
                        "--wave-window-ms", "800", "--progress-timeout", "10", log_path=tmp_path / "serve.log",
                        env={HOOKS_ENV: "1", FAULTS_ENV: "forward:*:boom-forward"})
    srv.start()
    try:
        results = submit_in_order(srv.url, [lambda: _post(srv, {**GOOD, "prompt": "boom-forward"}),
                                            lambda: _post(srv, GOOD)])
        for r in results:
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed", r.text[:300]
        assert srv.wait_exit(timeout=30) not in (0, None)
    finally:
        srv.stop(timeout=5)
    # by design: the other request of the wave is lost too (503, retried by the client)
    record("request_fault", mode="allgather", dp=2, phase="forward", faulty_status=503, same_wave_requests=2,
           requests_lost=1, engine_restarted=True)
