"""Folders a dlo command made for itself (a fetch's staging folder, `dlo quantize`'s `DST.partial`):
created with a marker file naming what made them, so that only such a folder is ever resumed or
removed; a folder of the same name without the marker is someone else's and is left alone.

Owns: `MARKER`, `make_marked`, `take_over` (a run that resumes a folder names itself in its marker,
so `maker_alive` speaks of the run at work), `marker_of`, `remove_marked`, `NotMarked`, `maker_alive`.
Must never: remove a folder whose marker names another maker or that has none (an empty folder is
the one exception: removing it loses nothing), follow a symbolic link, or import beyond the
standard library (the fetch runs in slim Jobs; `dlo quantize` imports it too).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

MARKER = ".dlo-staging"


class NotMarked(Exception):
    """A folder that this kind of process did not make: the message names it and its marker."""

    def __init__(self, path: Path, maker: str, found: dict[str, Any] | None) -> None:
        made = f"made by {found.get('made_by')!r}" if found else "no marker of a folder dlo made"
        super().__init__(f"{path} exists and was not made by {maker} ({made}): remove it yourself or choose "
                         "another destination")
        self.path = path


def make_marked(path: Path, maker: str, **facts: object) -> None:
    """Create the folder `path` (which must not exist) and mark it as made by `maker` (this process:
    its pid and host, so a later run can tell whether the maker is still at work)."""
    path.mkdir()
    _write_marker(path, {"made_by": maker, "created": _now(), **facts})


def take_over(path: Path, found: dict[str, Any]) -> None:
    """Name this process as the maker of `path` (marked `found`), which it resumes (the caller holds
    whatever lock makes it the only run at work there)."""
    _write_marker(path, {**found, "taken_over": _now()})


def _write_marker(path: Path, record: dict[str, Any]) -> None:
    record = {**record, "pid": os.getpid(), "host": socket.gethostname()}
    tmp = path / f"{MARKER}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path / MARKER)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def marker_of(path: Path) -> dict[str, Any] | None:
    """The marker of a folder a dlo command made, or None (no folder, a link, no readable marker)."""
    if path.is_symlink() or not path.is_dir():
        return None
    try:
        data = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("made_by"), str) else None


def remove_marked(path: Path, maker: str) -> None:
    """Remove `path` when `maker` made it (or it is an empty folder); else NotMarked. Nothing there:
    nothing to do."""
    if not path.exists() and not path.is_symlink():
        return
    if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        path.rmdir()
        return
    found = marker_of(path)
    if found is None or found["made_by"] != maker:
        raise NotMarked(path, maker, found)
    shutil.rmtree(path)


def maker_alive(found: dict[str, Any]) -> bool:
    """True when the process a marker names may still be running: another live process on this
    host (a marker from another host cannot be checked, so it counts as alive)."""
    if found.get("host") != socket.gethostname():
        return True
    pid = found.get("pid")
    if not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
