"""Progress of a fetch: a rich progress bar (bytes, rate, ETA) on a terminal, plain key=value lines
when the output is piped (a Job's log, which the operator reads for the status).

Owns: `Progress` (thread-safe counters), `progress_line` (the plain line, a contract: the operator
parses the last one with `parse_progress_line`) and the two renderers.
Must never: print from anywhere but the renderer it was given, or slow the transfer (rendering is
throttled; counting is one addition under a lock).
"""

from __future__ import annotations

import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

PLAIN_INTERVAL_S = 5.0
PROGRESS_LOGGER = "dlo.delivery.progress"  # under JSON logs the plain lines are its records (dlo.cli.logs)
_LINE = re.compile(r"fetch progress bytes=(\d+) total=(\d+) .*?files=(\d+)/(\d+)")


@dataclass(frozen=True)
class Snapshot:
    done: int
    total: int
    files_done: int
    files: int
    rate_bps: float
    eta_s: float | None

    @property
    def percent(self) -> float:
        return 100.0 * self.done / self.total if self.total else 100.0


def progress_line(s: Snapshot) -> str:
    eta = "unknown" if s.eta_s is None else f"{s.eta_s:.0f}"
    return (f"fetch progress bytes={s.done} total={s.total} percent={s.percent:.1f} rate_bps={s.rate_bps:.0f} "
            f"eta_s={eta} files={s.files_done}/{s.files}")


def parse_progress_line(text: str) -> tuple[int, int, int, int] | None:
    """(bytes, total, files done, files) of the last progress line in `text`, or None."""
    found = _LINE.findall(text)
    if not found:
        return None
    return tuple(int(x) for x in found[-1])  # type: ignore[return-value]


class Progress:
    """Counts bytes and files; `render` shows them (bar on a TTY, lines otherwise, or nothing)."""

    def __init__(self, mode: str = "auto", stream: IO[str] | None = None, interval_s: float = PLAIN_INTERVAL_S):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "plain"
        self.mode = mode
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self.total = self.done = self.files = self.files_done = 0
        self.downloaded = 0  # bytes this run moved (a resumed fetch starts with `done` > 0)
        self._start = time.monotonic()
        self._last_line = 0.0
        self._bar: Any = None
        self._started = False

    def start(self, total: int, files: int, already: int = 0, files_done: int = 0) -> None:
        with self._lock:
            self.total, self.files, self.done, self.files_done = total, files, already, files_done
            self._start = time.monotonic()
            self._started = True
        if self.mode == "bar":
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress as Bar, TextColumn,
                                       TimeRemainingColumn, TransferSpeedColumn)

            self._bar = Bar(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            TimeRemainingColumn(), console=Console(file=self.stream))
            self._bar.start()
            self._task = self._bar.add_task(f"fetch 0/{files} files", total=total, completed=already)
        self._render(force=True)

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            self.downloaded += n
        self._render()

    def rewind(self, n: int) -> None:
        """`n` bytes counted as done must be moved again (a file that failed its check)."""
        with self._lock:
            self.done -= n

    def file_done(self) -> None:
        with self._lock:
            self.files_done += 1
        self._render(force=self.mode == "plain")

    def snapshot(self) -> Snapshot:
        with self._lock:
            elapsed = max(time.monotonic() - self._start, 1e-6)
            rate = self.downloaded / elapsed
            left = self.total - self.done
            eta = left / rate if rate > 0 else (0.0 if left <= 0 else None)
            return Snapshot(self.done, self.total, self.files_done, self.files, rate, eta)

    def _render(self, force: bool = False) -> None:
        if not self._started:  # bytes before `start` (the small index files) count, unshown
            return
        if self.mode == "bar" and self._bar is not None:
            s = self.snapshot()
            self._bar.update(self._task, completed=s.done, description=f"fetch {s.files_done}/{s.files} files")
        elif self.mode == "plain":
            now = time.monotonic()
            if force or now - self._last_line >= self.interval_s:
                self._last_line = now
                print(progress_line(self.snapshot()), file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif self.mode == "plain" and self._started:
            print(progress_line(self.snapshot()), file=self.stream, flush=True)
        self._started = False
