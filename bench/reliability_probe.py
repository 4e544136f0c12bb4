"""What the attack benchmarks share (bench/reliability_attacks.py): processes, raw sockets, a /health
prober, tiny models. Not a benchmark itself.

Everything here works against any checkout's `dlo` (the one the running interpreter imports), so
the same attacks measure a tree before and after a change.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from dlo.engine.ports import free_port

DLO = [sys.executable, "-m", "dlo.cli.main"]


def dlo(*args: str, timeout: float = 120.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run one `dlo` subcommand to its end (stdout and stderr captured)."""
    return subprocess.run([*DLO, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def one_line_error(proc: subprocess.CompletedProcess) -> dict:
    """How a CLI refused: its exit code, whether it printed a traceback, its last stderr line."""
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    return {"rc": proc.returncode, "traceback": "Traceback" in proc.stderr,
            "last_line": lines[-1][:200] if lines else ""}


def tiny_models(root: Path) -> dict[str, Path]:
    """The tiny Wan text-to-video pipeline and the tiny Wan image-to-video one, written once."""
    out = {"wan": root / "tiny-wan", "i2v": root / "tiny-i2v"}
    if not (out["wan"] / "model_index.json").exists():
        dlo("make-tiny-model", str(out["wan"]), "--family", "wan").check_returncode()
    if not (out["i2v"] / "model_index.json").exists():
        shutil.rmtree(out["i2v"], ignore_errors=True)
        dlo("make-random-model", str(out["i2v"]), "--preset", "tiny-wan2.1-i2v", "--no-progress",
            timeout=600).check_returncode()
    return out


def get(url: str, timeout: float = 2.0, method: str = "GET", headers: dict | None = None,
        source: str | None = None) -> tuple[int, bytes]:
    """Status and body; 0 when the server did not answer within `timeout` (or refused). `source`: the
    client address to send from (another loopback address stands for another client)."""
    if source is not None:
        import http.client
        from urllib.parse import urlsplit

        u = urlsplit(url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout, source_address=(source, 0))
        try:
            conn.request(method, u.path or "/", headers=headers or {})
            r = conn.getresponse()
            return r.status, r.read()
        except (OSError, http.client.HTTPException):
            return 0, b""
        finally:
            conn.close()
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, ValueError):
        return 0, b""


def raw(port: int, data: bytes, timeout: float = 5.0, read_until_close: bool = True) -> bytes:
    """Send `data` on a new connection and read what comes back until the server closes (or `timeout`)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    out = b""
    try:
        s.sendall(data)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                break
            if not chunk:
                break
            out += chunk
            if not read_until_close and b"\r\n\r\n" in out:
                break
    except OSError:
        pass
    finally:
        s.close()
    return out


def status_of(response: bytes) -> int:
    try:
        return int(response.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


def open_sockets(port: int, n: int, first: bytes, connect_timeout: float = 2.0) -> list[socket.socket]:
    """`n` connections, each sending `first` (and then nothing); the ones the server accepted."""
    out = []
    for _ in range(n):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=connect_timeout)
            if first:
                s.sendall(first)
            out.append(s)
        except OSError:
            continue
    return out


def still_open(socks: list[socket.socket]) -> int:
    """How many of `socks` the server still holds silently (nothing to read: no answer, no close)."""
    import select

    held = 0
    for s in socks:
        try:
            readable, _, _ = select.select([s], [], [], 0)
        except (OSError, ValueError):
            continue
        held += 0 if readable else 1
    return held


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        try:
            s.close()
        except OSError:
            pass


@dataclass
class Prober:
    """GET `url` every `every_s` with a `timeout_s` deadline on a thread; what the clients of a
    probe (the kubelet, Prometheus) would have seen."""

    url: str
    every_s: float = 0.25
    timeout_s: float = 1.0
    source: str | None = None
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # (start, seconds, status)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> "Prober":
        def loop() -> None:
            while not self._stop.is_set():
                t0 = time.monotonic()
                code, _ = get(self.url, timeout=self.timeout_s, source=self.source)
                self.samples.append((t0, time.monotonic() - t0, code))
                self._stop.wait(max(0.0, self.every_s - (time.monotonic() - t0)))

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def figures(self) -> dict:
        """outage_s: time from a failed probe (not 200 within the timeout) to the next good answer
        (to the end of the window when none came); max_latency_s; probes; failed."""
        outage, start = 0.0, None
        for t0, secs, code in self.samples:
            ok = code == 200
            if not ok and start is None:
                start = t0
            elif ok and start is not None:
                outage += t0 + secs - start
                start = None
        if start is not None and self.samples:
            last = self.samples[-1]
            outage += last[0] + last[1] - start
        return {"outage_s": round(outage, 2), "max_latency_s": round(max((s for _, s, _ in self.samples), default=0), 2),
                "probes": len(self.samples), "failed": sum(1 for *_, c in self.samples if c != 200)}


def wait_for(cond: Callable[[], object], seconds: float, poll_s: float = 0.1) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(poll_s)
    return bool(cond())


class Agent:
    """`dlo agent` as a child process on a free loopback port, its log in `log`."""

    def __init__(self, models_root: Path, log: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.cmd = [*DLO, "agent", "--port", str(self.port), "--host", "127.0.0.1", "--kubernetes", "off",
                    "--models-root", str(models_root), *args]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Agent":
        self._f = open(self.log, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._f, stderr=subprocess.STDOUT, start_new_session=True)
        if not wait_for(lambda: get(self.url + "/health")[0] == 200, 60):
            raise RuntimeError(f"dlo agent did not answer /health within 60 s; log {self.log}")
        return self

    def threads(self) -> int:
        assert self.proc is not None
        try:
            return psutil.Process(self.proc.pid).num_threads()
        except psutil.Error:
            return 0

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._f.close()


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of a Prometheus exposition (None when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def samples(text: str, name: str) -> list[tuple[dict, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [(dict(s.labels), s.value) for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name]
