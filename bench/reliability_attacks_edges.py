"""HTTP edges and the smaller findings of bench/reliability_attacks.py: head sizes and framing
(RFC 9112), odd bodies and headers, the API key's file and characters, a port in use, the video
job cap. Each returns figures (what came back)."""

from __future__ import annotations

import inspect
import json
import os
import socket
import tempfile
import time
from pathlib import Path

from bench.reliability_probe import dlo, get, one_line_error, raw, status_of
from bench.reliability_attacks_serve import _multipart, _serve

KEY = "bench-key"


def _head(size: int) -> bytes:
    pad = b"X-Pad: " + b"a" * max(0, size - 40) + b"\r\n"
    return b"GET /health HTTP/1.1\r\nHost: x\r\n" + pad + b"\r\n"


def _answer(resp: bytes) -> list:
    head, _, _ = resp.partition(b"\r\n\r\n")
    ctype = next((line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-type:")), "")
    return [status_of(resp), ctype.split(";")[0]]


def _post(port: int, path: str, body: bytes, ctype: str = "application/json", extra: bytes = b"") -> list:
    req = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
           "Connection: close\r\n").encode() + extra + b"\r\n" + body
    resp = raw(port, req, timeout=30)
    _, _, payload = resp.partition(b"\r\n\r\n")
    try:
        code = (json.loads(payload).get("error") or {}).get("code")
    except ValueError:
        code = "not JSON"
    return [status_of(resp), code]


def framing(port: int) -> dict:
    """Item 8: head sizes, Content-Length with Transfer-Encoding: chunked and a request behind it, HEAD."""
    out = {f"head_{k}KiB": _answer(raw(port, _head(k * 1024), timeout=10)) for k in (8, 17, 100, 200)}
    smuggle = (b"POST /v1/models HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"0\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    resp = raw(port, smuggle, timeout=5)
    out["cl_and_te"] = {"responses": resp.count(b"HTTP/1.1 "), "closed_after_first": resp.count(b"HTTP/1.1 ") == 1}
    out["head_health"] = _answer(raw(port, b"HEAD /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", timeout=5))
    return out


def bodies(port: int) -> dict:
    """Item 9: a 5,000-digit integer, odd sizes, a multipart body without its closing boundary."""
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    out = {"int_5000_digits": _post(port, "/v1/images/generations",
                                    b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", extra=auth)}
    for name, size in (("size_newline", "64x64\n"), ("size_fullwidth_digits", "\uff16\uff14x64"), ("size_empty", "")):
        body = json.dumps({"prompt": "x", "size": size, "num_inference_steps": 1}).encode()
        out[name] = _post(port, "/v1/images/generations", body, extra=auth)
    body, ctype = _multipart({"prompt": "x", "size": "64x64", "seconds": "1"}, "input_reference", b"x", close=False)
    out["multipart_unclosed"] = _post(port, "/v1/videos", body, ctype, extra=auth)
    return out


def headers(port: int) -> dict:
    """Item 9: two Authorization headers (the right key first); the docs without a key."""
    two = f"Authorization: Bearer {KEY}\r\nAuthorization: Bearer wrong\r\n".encode()
    resp = raw(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + two + b"Connection: close\r\n\r\n", timeout=5)
    url = f"http://127.0.0.1:{port}"
    return {"two_authorization_headers": status_of(resp),
            **{f"no_key{path.replace('/', '_').replace('.', '_')}": get(url + path)[0]
               for path in ("/docs", "/redoc", "/openapi.json")}}


def key_files(root: Path, model: Path) -> dict:
    """Item 9: --api-key-file missing, a directory, not UTF-8; a non-ASCII key."""
    bad = root / "key-latin1"
    bad.write_bytes(b"caf\xe9")
    out = {}
    for name, path in (("missing", root / "no-such-key"), ("directory", root), ("not_utf8", bad)):
        out[f"key_file_{name}"] = one_line_error(dlo("serve", str(model), "--device", "cpu", "--small-limits",
                                                     "--port", "0", "--api-key-file", str(path), timeout=120))
    srv = _serve(model, root / "serve-nonascii.log", "--dp", "1", "--mode", "resident", "--no-warmup",
                 api_key="cl\u00e9")
    t0 = time.monotonic()
    try:
        srv.start(ready_timeout_s=120)
        status = get(srv.url + "/v1/models", headers={"Authorization": "Bearer cl\u00e9".encode().decode("latin-1")})[0]
        out["non_ascii_key"] = {"started": True, "v1_models_with_the_key": status}
    except RuntimeError:
        out["non_ascii_key"] = {"started": False, "rc": srv.proc.returncode if srv.proc else None,
                                "seconds_to_exit": round(time.monotonic() - t0, 1)}
    finally:
        srv.stop()
    return out


def port_in_use(root: Path, model: Path) -> dict:
    """Item 9: the port is taken: how long until `dlo serve` says so, and with which code."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    t0 = time.monotonic()
    try:
        proc = dlo("serve", str(model), "--device", "cpu", "--small-limits", "--dp", "1", "--mode", "resident",
                   "--no-warmup", "--port", str(port), "--video-dir", tempfile.mkdtemp(prefix="dlo-bench-"),
                   timeout=300)
    finally:
        s.close()
    return {**one_line_error(proc), "seconds_to_exit": round(time.monotonic() - t0, 1)}


def job_cap() -> dict:
    """Item 9: at the store's cap, does another client's new job evict a finished job within its TTL?"""
    from dlo.serving.videos import VideoJob, VideoStore

    with tempfile.TemporaryDirectory() as d:
        store = VideoStore(d, max_jobs=8)
        store.load()
        takes_client = "client" in inspect.signature(store.add).parameters

        def add(client: str) -> str | None:
            job = VideoJob(id=store.new_id(), created_at=int(time.time()), model="m", prompt="p", seconds="1",
                           size="64x64", steps=1)
            try:
                store.add(job, client=client) if takes_client else store.add(job)
            except Exception as e:  # the store refused it (the fix): a domain error
                return type(e).__name__
            store.complete(job.id)
            return job.id

        victim = add("a")
        refusals = [r for r in (add("b") for _ in range(16)) if r is not None and not r.startswith("video_")]
        return {"victim_job_kept": victim in store, "other_client_refused": len(refusals),
                "refused_with": sorted(set(refusals))}


def run(root: Path, models: dict[str, Path]) -> dict:
    model = models["wan"]
    with _serve(model, root / "serve-edges.log", "--dp", "1", "--mode", "resident", "--no-warmup",
                api_key=KEY) as srv:
        out = {"framing": framing(srv.port), "bodies": bodies(srv.port), "headers": headers(srv.port)}
    out["key_files"] = key_files(root, model)
    out["port_in_use"] = port_in_use(root, model)
    out["job_cap"] = job_cap()
    os.environ.pop("DLO_API_KEY", None)
    return out
