"""The device prelude's Python half: a private site that holds exactly the lock's package set.

    python3 -m bench.lib.device_env SITE   # run by bench/device.sh with the device's own python3

Owns: `prepare` (SITE, already holding the wheels of `.whl/` that `bench/device.sh` installed, gets
every other locked distribution linked from this interpreter's installation (torch and its CUDA
libraries, preinstalled on the device), `dlo` as links to this checkout's package folders (as
pyproject's package-dir maps them) and `bench`; returns what it linked, what the device lacked
and what it has at another version than the lock).
Must never: import anything but the standard library (it runs before the site exists) or add a
distribution the lock does not name (what the engine image leaves out stays out of the measurement).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import sys
from pathlib import Path

from bench.lib.packages import LOCK, canonical, read_lock

REPO = Path(__file__).resolve().parents[2]


def package_folders(root: Path = REPO) -> dict[str, Path]:
    """`dlo.X` -> its folder, as pyproject.toml's package-dir maps the top-level parts."""
    import tomllib

    dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name.split(".")[1]: root / folder for name, folder in dirs.items() if name.count(".") == 1}


def link_checkout(site: Path, root: Path = REPO) -> None:
    """`dlo` (a namespace of links to the part folders) and `bench` in `site`."""
    (site / "dlo").mkdir(parents=True, exist_ok=True)
    for part, folder in package_folders(root).items():
        link = site / "dlo" / part
        if not link.exists():
            link.symlink_to(folder)
    if not (site / "bench").exists():
        (site / "bench").symlink_to(root / "bench")


def _link_distribution(dist: md.Distribution, site: Path) -> None:
    tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
    for top in sorted(tops):
        target = Path(str(dist.locate_file(top)))
        link = site / top
        if target.exists() and not link.exists() and not link.is_symlink():
            link.symlink_to(target)


def prepare(site: Path, lock_path: Path = LOCK) -> dict[str, list[str]]:
    lock = read_lock(lock_path)
    present = {canonical(d.metadata["Name"]): d.version for d in md.distributions(path=[str(site)])}
    system = {canonical(d.metadata["Name"]): d for d in md.distributions() if d.metadata["Name"]}
    out: dict[str, list[str]] = {"installed": sorted(present), "linked": [], "missing": [], "other_version": []}
    for name, version in sorted(lock.items()):
        if name in present:
            if present[name] != version:
                out["other_version"].append(f"{name}=={present[name]} (lock {version})")
            continue
        dist = system.get(name)
        if dist is None:
            out["missing"].append(f"{name}=={version}")
            continue
        _link_distribution(dist, site)
        out["linked"].append(f"{name}=={dist.version}")
        if dist.version != version:
            out["other_version"].append(f"{name}=={dist.version} (lock {version})")
    link_checkout(site)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python3 -m bench.lib.device_env SITE", file=sys.stderr)
        return 2
    print(json.dumps(prepare(Path(argv[0])), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
