"""The device prelude's Python half: the carried wheel set gathered, and a private site that holds
exactly the lock's package set.

    python3 -m bench.lib.device_env gather STORE .whl .whl-2 ...   # run by bench/device.sh
    python3 -m bench.lib.device_env site SITE

Owns: `gather` (the folders `python -m bench wheels` wrote, carried one a call, copied into STORE, a
folder that outlives the call on the device; each wheel rebuilt from its chunks and checked against
the manifest's sha256; returns the wheels still missing), `prepare` (SITE, already holding those
wheels, gets
every other locked distribution linked from this interpreter's installation (torch and its CUDA
libraries, preinstalled on the device), `dlo` as links to this checkout's package folders (as
pyproject's package-dir maps them) and `bench`; returns what it linked, what the device lacked
and what it has at another version than the lock).
Must never: import anything but the standard library (it runs before the site exists) or add a
distribution the lock does not name (what the engine image leaves out stays out of the measurement).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import shutil
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


def gather(store: Path, folders: list[Path]) -> list[str]:
    """Every carried part's chunks into `store`; the wheels whose chunks are all there rebuilt and
    checked. Returns the wheels of the manifest still missing (a part not carried yet)."""
    store.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, dict] = {}
    for folder in folders:
        if (folder / "MANIFEST.json").is_file():
            manifest = json.loads((folder / "MANIFEST.json").read_text())["wheels"]
            for chunk in folder.glob("*.whl.[0-9][0-9][0-9]"):
                shutil.copyfile(chunk, store / chunk.name)
    missing = []
    for name, entry in sorted(manifest.items()):
        chunks = [store / f"{name}.{i:03d}" for i in range(entry["chunks"])]
        if (store / name).is_file():
            continue
        if not all(c.is_file() for c in chunks):
            missing.append(name)
            continue
        data = b"".join(c.read_bytes() for c in chunks)
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise SystemExit(f"device_env: {name} does not match its manifest's sha256 (a damaged part)")
        (store / name).write_bytes(data)
    return missing


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "gather":
        missing = gather(Path(argv[1]), [Path(a) for a in argv[2:]])
        if missing:
            print(f"device_env: {len(missing)} wheels not carried yet (the next part: .whl-N), e.g. {missing[:3]}",
                  file=sys.stderr)
            return 3
        return 0
    if len(argv) == 2 and argv[0] == "site":
        print(json.dumps(prepare(Path(argv[1])), indent=1))
        return 0
    print("usage: python3 -m bench.lib.device_env gather STORE FOLDER... | site SITE", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
