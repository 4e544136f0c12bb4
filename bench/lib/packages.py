"""The package set a run had, and the committed lock it is held to.

Owns: `LOCK` (the pinned set the engine image installs and the device measurements use: `engine.lock`
in requirements/), `read_lock` (its `name==version` pins), `installed` (this interpreter's
distributions), `package_set` (their digest, and how they differ from the lock) and
`installed_version`.
Must never: import a package to learn its version (importlib.metadata reads the installed metadata).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements" / "engine.lock"
# installers and the project itself: never part of the comparison
TOOLS = frozenset({"pip", "wheel", "dlo"})
# what the locked torch build pins itself (its CUDA libraries, triton): the build's, not the lock's
TORCH_PINS = re.compile(r"^(nvidia-.*|triton|cuda-.*)$")
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """{canonical name: version} of every `name==version` line (hashes, options and comments skipped)."""
    pins = {}
    for line in path.read_text().splitlines():
        m = PIN.match(line.strip())
        if m:
            pins[canonical(m.group(1))] = m.group(2)
    return pins


def installed() -> dict[str, str]:
    return {canonical(d.metadata["Name"]): d.version for d in md.distributions() if d.metadata["Name"]}


def installed_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def digest(pins: dict[str, str]) -> str:
    return "sha256:" + hashlib.sha256("\n".join(f"{n}=={v}" for n, v in sorted(pins.items())).encode()).hexdigest()


def differences(have: dict[str, str], lock: dict[str, str]) -> dict[str, list[str]]:
    """What `have` lacks of `lock`, has beyond it, and has at another version (installers left out,
    and the CUDA libraries and triton a locked torch build pins itself)."""
    names = (set(have) | set(lock)) - TOOLS
    if "torch" in lock:
        names = {n for n in names if n in lock or not TORCH_PINS.match(n)}
    return {"missing": sorted(f"{n}=={lock[n]}" for n in names if n in lock and n not in have),
            "extra": sorted(f"{n}=={have[n]}" for n in names if n in have and n not in lock),
            "other_version": sorted(f"{n}=={have[n]} (lock {lock[n]})" for n in names
                                    if n in have and n in lock and have[n] != lock[n])}


def package_set(lock_path: Path = LOCK) -> dict[str, Any]:
    """This interpreter's set: its digest, its size, and where it departs from the lock."""
    have = installed()
    out: dict[str, Any] = {"digest": digest({n: v for n, v in have.items() if n not in TOOLS}), "count": len(have)}
    if not lock_path.is_file():
        return {**out, "lock": None}
    lock = read_lock(lock_path)
    diff = differences(have, lock)
    return {**out, "lock": lock_path.name, "lock_digest": digest(lock),
            "matches_lock": not any(diff.values()), **diff}
