"""The engine's package set: `requirements/engine.in` resolved into the committed lock, and the wheel
set a device call carries, built from the lock.

    python -m bench lock                  # engine.in -> requirements/engine.lock (pins and sha256 hashes)
    python -m bench wheels [--have FREEZE] # the lock's wheels for the device (cp312) into .whl/, .whl-2/, ...

Owns: `lock` (pip's resolver on the image's platform (CPython 3.12, manylinux x86_64, binary wheels
only) over engine.in, every distribution pinned with its hashes; torch stands for itself: a stand-in
wheel with torch's own non-CUDA requirements, so its CUDA libraries and triton stay the pins of the
torch build the image installs from the torch index and the device has preinstalled) and `wheels`
(the lock's wheels but torch's, downloaded with their hashes checked, spread over folders of one
call's carry each (`split_into_parts`: `.whl`, `.whl-2`, ...; a larger wheel in chunks), each with
the manifest of the whole set; `--have` leaves out what a device's `pip list --format=freeze`
already holds at the locked version; the stamp of `python -m bench stamp` in `.whl/`).
Must never: install anything here, or write a lock that pip could not check (every pin hashed).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from bench.lib.packages import LOCK, canonical, read_lock
from bench.lib.provenance import write_stamp

REQUIREMENTS = LOCK.parent / "engine.in"
WHEELS = LOCK.parents[1] / ".whl"
TORCH_LOCAL = "2.11.0+cu130"  # the build of the torch index the image and the device have
# torch's own requirements but its CUDA libraries and triton (whose pins are the build's)
TORCH_REQUIRES = ["filelock", "typing-extensions>=4.10.0", "setuptools>=77.0.3", "sympy>=1.13.3",
                  "networkx>=2.5.1", "jinja2", "fsspec>=0.8.5"]
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
            *[a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                          "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64", "linux_x86_64")
              for a in ("--platform", p)], "--only-binary=:all:"]


def _stand_in_torch(folder: Path) -> Path:
    """A torch wheel holding only its metadata (its non-CUDA requirements)."""
    name = f"torch-{TORCH_LOCAL}"
    meta = "\n".join(["Metadata-Version: 2.1", "Name: torch", f"Version: {TORCH_LOCAL}",
                      *[f"Requires-Dist: {r}" for r in TORCH_REQUIRES]]) + "\n"
    files = {f"{name}.dist-info/METADATA": meta,
             f"{name}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: bench\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(t.encode())}" for p, t in files.items()] + [f"{name}.dist-info/RECORD,,"]
    path = folder / f"{name}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, t in {**files, f"{name}.dist-info/RECORD": "\n".join(record) + "\n"}.items():
            z.writestr(p, t)
    return path


def _pip(*args: str) -> None:
    # the index alone: no site configuration's mirrors or local folders in what the lock names
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": ""}
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, env=env)


def resolve(index: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        stand_in = _stand_in_torch(Path(tmp))
        report = Path(tmp) / "report.json"
        _pip("install", "--quiet", "--dry-run", "--ignore-installed", "--report", str(report), "--target",
             str(Path(tmp) / "t"), *PLATFORM, "--index-url", index, "--find-links", str(stand_in.parent),
             "-r", str(REQUIREMENTS))
        return json.loads(report.read_text())["install"]


def lock(index: str) -> str:
    lines = ["# The engine image's package set, pinned with hashes: python -m bench lock (from engine.in).",
             "# CPython 3.12, manylinux x86_64. torch is the build of the torch index (cu130): its CUDA libraries",
             "# and triton are the versions that build pins; the Dockerfile installs it after this file (--no-deps),",
             "# bench/device.sh links the device's own. Everything else here is all the image holds.",
             f"torch=={TORCH_LOCAL}"]
    for item in sorted(resolve(index), key=lambda i: canonical(i["metadata"]["name"])):
        name, version = canonical(item["metadata"]["name"]), item["metadata"]["version"]
        if name == "torch":
            continue
        sha = item["download_info"]["archive_info"]["hashes"]["sha256"]
        lines.append(f"{name}=={version} \\\n    --hash=sha256:{sha}")
    return "\n".join(lines) + "\n"


def pypi_lines(have: dict[str, str]) -> list[str]:
    """The lock's entries but torch's (and what `have` holds at the locked version), hashes kept."""
    pins = read_lock()
    out, skip = [], False
    for line in LOCK.read_text().splitlines():
        if line.startswith("#"):
            continue
        if not line.startswith(" "):
            name = canonical(line.split("==")[0])
            skip = name == "torch" or have.get(name) == pins.get(name)
        if not skip:
            out.append(line)
    return out


def split_into_parts(staging: Path, dest: Path, part_bytes: int) -> list[Path]:
    """The wheels of `staging` spread over carry-sized folders `dest`, `dest-2`, ... (a wheel larger
    than a part in chunks across them), each with the manifest of the whole set."""
    manifest: dict[str, dict] = {}
    parts: list[list[tuple[str, bytes]]] = [[]]
    room = part_bytes
    for whl in sorted(staging.glob("*.whl"), key=lambda p: -p.stat().st_size):
        data = whl.read_bytes()
        manifest[whl.name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "chunks": 0}
        for start in range(0, len(data), part_bytes):
            chunk = data[start:start + part_bytes]
            if len(chunk) > room:
                parts.append([])
                room = part_bytes
            parts[-1].append((f"{whl.name}.{manifest[whl.name]['chunks']:03d}", chunk))
            manifest[whl.name]["chunks"] += 1
            room -= len(chunk)
    folders = []
    for i, files in enumerate(parts):
        folder = dest if i == 0 else dest.with_name(f"{dest.name}-{i + 1}")
        folder.mkdir(parents=True, exist_ok=True)
        for old in [*folder.glob("*.whl"), *folder.glob("*.whl.[0-9][0-9][0-9]")]:
            old.unlink()
        for name, chunk in files:
            (folder / name).write_bytes(chunk)
        (folder / "MANIFEST.json").write_text(json.dumps({"parts": len(parts), "wheels": manifest}, indent=1) + "\n")
        folders.append(folder)
    return folders


def wheels(dest: Path, have_file: Path | None, index: str, part_mib: int) -> list[Path]:
    have = {}
    if have_file is not None:
        have = {canonical(n): v for n, _, v in (ln.partition("==") for ln in have_file.read_text().split()) if v}
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "req.txt"
        req.write_text("\n".join(pypi_lines(have)) + "\n")
        staging = Path(tmp) / "wheels"
        _pip("download", "--quiet", "--no-deps", "--require-hashes", "-d", str(staging), *PLATFORM,
             "--index-url", index, "-r", str(req))
        folders = split_into_parts(staging, dest, part_mib * 2**20)
    write_stamp(dest / "SOURCE.json")
    return folders


def main(tool: str, argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog=f"python -m bench {tool}", description=__doc__.splitlines()[0])
    ap.add_argument("--index-url", default="https://pypi.org/simple", help="the package index (default PyPI)")
    if tool == "wheels":
        ap.add_argument("--dest", type=Path, default=WHEELS, help="the wheel folder (default .whl/, git-ignored)")
        ap.add_argument("--have", type=Path, default=None,
                        help="a device's `pip list --format=freeze`: what it holds at the locked version stays out")
        ap.add_argument("--part-mib", type=int, default=60,
                        help="the most one folder holds (a call carries 64 MiB): .whl, .whl-2, ... one a call")
    args = ap.parse_args(argv)
    if tool == "lock":
        LOCK.write_text(lock(args.index_url))
        print(f"wrote {LOCK} ({len(read_lock())} pins)")
    else:
        folders = wheels(args.dest, args.have, args.index_url, args.part_mib)
        print(f"wrote {', '.join(map(str, folders))}: carry one a call (bench/device.sh gathers them on the device)")
    return 0
