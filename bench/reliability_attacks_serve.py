"""`dlo serve`'s attacks of bench/reliability_attacks.py: slow bodies against the connection cap,
clients that leave, big reference images, a read-only video folder, a silent peer on the control
socket. Each returns figures."""

from __future__ import annotations

import io
import json
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import psutil

from dlo.serving.launch import ServerProcess
from bench.reliability_probe import Prober, close_all, get, metric, open_sockets, raw, samples, status_of, still_open, \
    wait_for

TINY = ("--device", "cpu", "--small-limits")


def _serve(model: Path, log: Path, *args: str, **kw: object) -> ServerProcess:
    return ServerProcess(model, *TINY, *args, log_path=log, **kw)  # type: ignore[arg-type]


def _image_request(prompt: str, steps: int = 4, size: str = "64x64") -> bytes:
    body = json.dumps({"prompt": prompt, "size": size, "num_inference_steps": steps}).encode()
    return (b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def slow_bodies(root: Path, model: Path, window_s: float = 25.0) -> dict:
    """Item 3: with --max-connections 4, two clients stop after part of their body and two trickle
    one byte a second; /health meanwhile (a probe from loopback, as the kubelet's would be)."""
    head = (b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 4000\r\n\r\n{\"prompt\": ")
    with _serve(model, root / "serve-slow.log", "--dp", "1", "--mode", "resident", "--no-warmup",
                "--max-connections", "4") as srv:
        socks = open_sockets(srv.port, 4, head)  # first: they hold every place of the cap
        with Prober(srv.url + "/health") as probe:
            stop = threading.Event()

            def trickle() -> None:
                while not stop.wait(1.0):
                    for s in socks[2:]:
                        try:
                            s.send(b"a")
                        except OSError:
                            pass

            t = threading.Thread(target=trickle, daemon=True)
            t.start()
            time.sleep(window_s)
            held = still_open(socks)
            stop.set()
            t.join()
            close_all(socks)
    return {"max_connections": 4, "slow_clients": 4, "held_after_window": held, "window_s": window_s,
            **probe.figures()}


def disconnects(root: Path, model: Path, n: int = 30) -> dict:
    """Item 4: `n` image requests whose sockets close 50 ms after sending; how many ran on the ranks
    (dlo_wave_size's sum: requests that reached a wave) and how they were counted."""
    with _serve(model, root / "serve-disconnect.log", "--dp", "1", "--mode", "resident", "--no-warmup") as srv:
        before = get(srv.url + "/metrics")[1].decode()
        ran0 = metric(before, "dlo_wave_size_sum") or 0.0
        socks = []
        for i in range(n):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(_image_request(f"left {i}"))
            socks.append(s)
        time.sleep(0.05)
        close_all(socks)
        idle = lambda: json.loads(get(srv.url + "/health")[1] or b"{}")  # noqa: E731
        time.sleep(1.0)
        wait_for(lambda: idle().get("queued", 1) == 0 and idle().get("running", 1) == 0, 120, poll_s=0.5)
        time.sleep(1.0)
        text = get(srv.url + "/metrics")[1].decode()
    codes: dict[str, float] = {}
    for labels, v in samples(text, "dlo_requests_total"):
        if labels.get("endpoint") == "/v1/images/generations":
            codes[labels["code"]] = codes.get(labels["code"], 0) + v
    return {"requests": n, "ran_on_ranks": int((metric(text, "dlo_wave_size_sum") or 0) - ran0), "counted": codes}


def _black_png(side: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side)).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def _multipart(fields: dict[str, str], file_name: str, data: bytes, close: bool = True) -> tuple[bytes, str]:
    boundary = "dlobenchboundary"
    parts = [f"--{boundary}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n".encode()
             for k, v in fields.items()]
    parts.append(f"--{boundary}\r\nContent-Disposition: form-data; name=\"{file_name}\"; filename=\"a.png\"\r\n"
                 "Content-Type: image/png\r\n\r\n".encode() + data + b"\r\n")
    if close:
        parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def reference_images(root: Path, model: Path, n: int = 20, limits: dict | None = None) -> dict:
    """Item 5: `n` concurrent video requests, each with a 4096x4096 all-black PNG (under the body
    limit) as input_reference; /health meanwhile, and what the requests got. `limits`: a limits
    file over the small profile (e.g. a pixel cap that lets the images through, to be decoded)."""
    png = _black_png(4096)
    body, ctype = _multipart({"prompt": "a cat", "size": "64x64", "seconds": "1"}, "input_reference", png)
    extra: tuple[str, ...] = ()
    if limits is not None:
        path = root / "limits-i2v.json"
        path.write_text(json.dumps(limits))
        extra = ("--limits", str(path))
    srv = _serve(model, root / "serve-i2v.log", "--dp", "1", "--mode", "resident", "--no-warmup", "--max-queue", "64",
                 *extra)
    try:
        srv.start()
    except RuntimeError as e:  # a tree whose limits do not know the field
        return {"skipped": f"the server refused the limits {limits}: {e}"[:200]}
    codes: list[int] = []

    def post() -> None:
        req = (b"POST /v1/videos HTTP/1.1\r\nHost: x\r\nContent-Type: " + ctype.encode() +
               b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        codes.append(status_of(raw(srv.port, req, timeout=60)))

    try:
        with Prober(srv.url + "/health", every_s=0.1) as probe:
            time.sleep(0.5)
            threads = [threading.Thread(target=post) for _ in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            time.sleep(0.5)
    finally:
        srv.stop()
    return {"png_bytes": len(png), "requests": n, "answers": {str(c): codes.count(c) for c in sorted(set(codes))},
            **probe.figures()}


def _mount_tmpfs(path: Path, read_only: bool) -> bool:
    opts = "remount,ro" if read_only else "size=64m"
    args = ["mount", "-o", opts, path] if read_only else ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path]
    return subprocess.run(args, capture_output=True).returncode == 0


def read_only_videos(root: Path, model: Path) -> dict:
    """Item 6: a finished job on a folder that turns read-only; DELETE, GET, a restart, a create."""
    folder = root / "ro-videos"
    folder.mkdir(exist_ok=True)
    if not _mount_tmpfs(folder, read_only=False):
        return {"skipped": "cannot mount a tmpfs here (needs root)"}
    try:
        video = {"prompt": "a cat", "size": "64x64", "seconds": "1"}
        args = ("--dp", "1", "--mode", "resident", "--no-warmup", "--video-dir", str(folder))
        with _serve(model, root / "serve-ro.log", *args) as srv:
            import requests

            job = requests.post(srv.url + "/v1/videos", json=video, timeout=30).json()
            wait_for(lambda: requests.get(f"{srv.url}/v1/videos/{job['id']}", timeout=5).json()["status"]
                     in ("completed", "failed"), 120, poll_s=0.3)
            _mount_tmpfs(folder, read_only=True)
            deleted = requests.delete(f"{srv.url}/v1/videos/{job['id']}", timeout=10)
            after = requests.get(f"{srv.url}/v1/videos/{job['id']}", timeout=10)
        files_left = sorted(p.name for p in folder.iterdir())
        log2 = root / "serve-ro-restart.log"
        with _serve(model, log2, *args) as srv:
            back = requests.get(f"{srv.url}/v1/videos/{job['id']}", timeout=10)
            create = requests.post(srv.url + "/v1/videos", json=video, timeout=30)
        warned = any("read-only" in line or "read only" in line for line in log2.read_text(errors="replace").splitlines()
                     if "WARNING" in line)
        answer = deleted.json()
        return {"delete": [deleted.status_code, answer.get("deleted", (answer.get("error") or {}).get("code"))],
                "get_after_delete": after.status_code, "files_left": len(files_left),
                "after_restart": back.status_code,
                "create_on_read_only": [create.status_code, (create.json().get("error") or {}).get("code")],
                "warned_at_start": warned}
    finally:
        subprocess.run(["umount", folder], capture_output=True)


def _control_port(pid: int, http_port: int) -> int | None:
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return None
    ports = [c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port != http_port]
    return min(ports) if ports else None


def silent_control_peer(root: Path, model: Path, hold_s: float = 60.0) -> dict:
    """Item 7: a local connection to rank 0's control socket before the child ranks connect (they are
    stopped until it is made); seconds until /ready, or what /health and /ready said after `hold_s`;
    then the connection closes: does the engine survive it?"""
    srv = _serve(model, root / "serve-control.log", "--dp", "2", "--mode", "allgather", "--no-warmup")
    srv._log = open(srv.log_path, "wb")  # type: ignore[arg-type]
    srv.proc = subprocess.Popen(srv.cmd, env=srv.env, stdout=srv._log, stderr=subprocess.STDOUT, start_new_session=True)
    peer: socket.socket | None = None
    try:
        parent = psutil.Process(srv.proc.pid)
        stopped: list[psutil.Process] = []
        wait_for(lambda: bool(parent.children()), 60, poll_s=0.002)
        for child in parent.children():
            child.send_signal(signal.SIGSTOP)
            stopped.append(child)
        port = None
        wait_for(lambda: (port := _control_port(srv.proc.pid, srv.port)) is not None, 30, poll_s=0.01)
        port = _control_port(srv.proc.pid, srv.port)
        if port is None or not stopped:
            return {"skipped": "no control port or child seen in time"}
        peer = socket.create_connection(("127.0.0.1", port), timeout=5)
        t0 = time.monotonic()
        for child in stopped:
            child.send_signal(signal.SIGCONT)
        ready = wait_for(lambda: get(srv.url + "/ready")[0] == 200 or srv.proc.poll() is not None, hold_s, poll_s=0.25)
        waited = time.monotonic() - t0
        health, ready_code = get(srv.url + "/health")[0], get(srv.url + "/ready")[0]
        out = {"ready": ready and ready_code == 200, "seconds_to_ready_or_exit": round(waited, 1),
               "health_after": health, "ready_after": ready_code, "exited": srv.proc.poll()}
        peer.close()
        peer = None
        time.sleep(3.0)
        out["exit_code_after_peer_closed"] = srv.proc.poll()
        return out
    finally:
        if peer is not None:
            peer.close()
        srv.stop()


def run(root: Path, models: dict[str, Path]) -> dict:
    return {
        "serve_slow_bodies": slow_bodies(root, models["wan"]),
        "serve_disconnects": disconnects(root, models["wan"]),
        "serve_reference_images": reference_images(root, models["i2v"]),
        # the default cap (4096 x 4096) over the small profile: every image is decoded
        "serve_reference_images_decoded": reference_images(root, models["i2v"], limits={
            "max_width": 128, "max_height": 128, "max_steps": 4, "default_steps": 2, "max_frames": 9, "video_fps": 2,
            "default_size": "64x64", "default_video_size": "64x64", "max_body_bytes": 65536,
            "max_reference_pixels": 4096 * 4096}),
        "serve_read_only_videos": read_only_videos(root, models["wan"]),
        "serve_silent_control_peer": silent_control_peer(root, models["wan"]),
    }

