"""What every record says about where it was made: the commit, the card, the libraries, the package
set and the command.

Owns: `provenance` (the `provenance` object of a record, read once per run), `read_card` (read from
the device: name, memory, count, driver; the host's CPU for a CPU run), `commit_of` (git, else the
stamp `python -m bench stamp` leaves in `.whl/` when its source digest still matches) and
`source_digest` (the product and bench sources, so a copy of the tree without git still names them).
Must never: guess. A field it cannot read is None and `told_by` says how each was read.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.lib import packages

REPO = Path(__file__).resolve().parents[2]
STAMP = REPO / ".whl" / "SOURCE.json"
FORMAT = 1
LIBRARIES = ("torch", "diffusers", "transformers", "safetensors", "accelerate", "numpy")


def source_digest(root: Path = REPO) -> str:
    """sha256 over the Python sources of the product folders, bench/ and pyproject.toml (path and bytes)."""
    import tomllib

    dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    files = sorted({p for d in [*dirs, "bench"] for p in (root / d).glob("*.py")} | {root / "pyproject.toml"})
    h = hashlib.sha256()
    for p in files:
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def commit_of(root: Path = REPO) -> dict[str, Any]:
    digest = source_digest(root)
    sha = _git("rev-parse", "HEAD") if (root / ".git").exists() else None
    if sha:
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
        return {"sha": sha, "dirty": dirty, "source_digest": digest, "told_by": "git"}
    try:
        stamp = json.loads((root / ".whl" / "SOURCE.json").read_text())
    except (OSError, ValueError):
        return {"sha": None, "dirty": None, "source_digest": digest,
                "told_by": "no git and no .whl/SOURCE.json (run python -m bench stamp before the call)"}
    same = stamp.get("source_digest") == digest
    return {"sha": stamp.get("sha"), "dirty": stamp.get("dirty") if same else True, "source_digest": digest,
            "told_by": ".whl/SOURCE.json" + ("" if same else ": the sources changed since the stamp")}


def write_stamp(path: Path = STAMP) -> dict[str, Any]:
    """The commit and source digest of this checkout, for a copy of the tree that has no git."""
    stamp = commit_of()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stamp, indent=1) + "\n")
    return stamp


def _driver() -> tuple[str | None, str]:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return (v.decode() if isinstance(v, bytes) else v), "NVML"
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no NVML here: nvidia-smi, else unknown
        pass
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.split()[0], "nvidia-smi"
    except (OSError, subprocess.TimeoutExpired):
        pass
    return None, "neither NVML nor nvidia-smi answered"


def _cpu_card() -> dict[str, Any]:
    name = platform.processor() or platform.machine()
    memory = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"name": f"cpu: {name}", "memory_bytes": memory, "count": os.cpu_count(), "driver": None,
            "told_by": "/proc/cpuinfo and /proc/meminfo"}


def read_card(device: str) -> dict[str, Any]:
    """The card the run used, read from it (cuda through torch; else this host's CPU)."""
    if not device.startswith("cuda"):
        return _cpu_card()
    import torch

    index = torch.device(device).index or 0
    props = torch.cuda.get_device_properties(index)
    driver, how = _driver()
    return {"name": props.name, "memory_bytes": int(props.total_memory), "count": torch.cuda.device_count(),
            "driver": driver, "cuda": torch.version.cuda,
            "told_by": f"torch.cuda.get_device_properties({index}); driver by {how}"}


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        out[name] = packages.installed_version(name)
    return out


def provenance(device: str, argv: list[str] | None = None) -> dict[str, Any]:
    """The `provenance` object of a record made now, on `device`, by `argv` (default: this process's)."""
    args = sys.argv if argv is None else argv
    head = ["python", "-m", "bench"] if args and args[0].endswith("__main__.py") else ["python", args[0] if args else ""]
    command = shlex.join([*head, *args[1:]])
    return {"format": FORMAT, "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": command, "commit": commit_of(), "card": read_card(device), "versions": versions(),
            "packages": packages.package_set()}
