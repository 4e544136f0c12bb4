"""Run `dlo serve` as a child process: start it, wait until it is ready, read its metrics, stop it.

Owns: the one way the demo, the benchmarks and the tests start a real server (a separate process
tree, real HTTP). Unless `--video-dir` is given, each server keeps its video jobs in a temp folder
of its own, removed by `stop()`. Must never: leave a server running after `stop()` or the context
exits.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from dlo.engine.ports import free_port


class ServerProcess:
    """`with ServerProcess(model_dir, "--dp", "2") as srv: srv.url ...`"""

    def __init__(self, model_dir: Path | str, *args: str, api_key: str | None = None, log_path: Path | None = None,
                 env: dict[str, str] | None = None, nofile: int | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.video_dir: str | None = None  # ours to remove
        if "--video-dir" not in args:
            self.video_dir = tempfile.mkdtemp(prefix="dlo-videos-")
            args = (*args, "--video-dir", self.video_dir)
        self.cmd = [sys.executable, "-m", "dlo.cli.main", "serve", str(model_dir), "--port", str(self.port), *args]
        self.env = {**os.environ, **(env or {})}
        self.env.pop("DLO_API_KEY", None)
        if api_key is not None:
            self.env["DLO_API_KEY"] = api_key
        self.log_path = log_path
        self.nofile = nofile  # RLIMIT_NOFILE of the server (soft = hard), e.g. to test descriptor exhaustion
        self.proc: subprocess.Popen | None = None
        self._log: Any = None

    def start(self, ready_timeout_s: float = 180.0, poll_s: float = 0.2) -> "ServerProcess":
        """Start the server and return once `/ready` answers 200 (asked every `poll_s`)."""
        self._log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=self._limits if self.nofile else None)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dlo serve exited with code {self.proc.returncode} before ready; log: {self.log_path}")
            try:
                if self.get("/ready")[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(poll_s)
        self.stop()
        raise TimeoutError(f"dlo serve not ready within {ready_timeout_s:.0f} s; log: {self.log_path}")

    def _limits(self) -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def ready_info(self) -> dict:
        return json.loads(self.get("/ready")[1])

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """name -> [(labels, value)] of every sample in /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for fam in text_string_to_metric_families(self.get("/metrics")[1].decode()):
            for s in fam.samples:
                out.setdefault(s.name, []).append((dict(s.labels), s.value))
        return out

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (graceful: ranks stop, exit code 0), SIGKILL of the whole group after `timeout`."""
        if self.proc is None:
            self._remove_video_dir()
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        self._remove_video_dir()
        return self.proc.returncode

    def _remove_video_dir(self) -> None:
        if self.video_dir is not None:
            shutil.rmtree(self.video_dir, ignore_errors=True)

    def __enter__(self) -> "ServerProcess":
        """Start the server, unless `start()` already did (`with` then only stops it at the end: a
        second start would orphan the first process)."""
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
