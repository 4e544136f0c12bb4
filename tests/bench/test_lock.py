"""The engine's package set: the committed lock pins (and hashes) everything engine.in asks for and
nothing a serve never imports; the device's wheel set is built from it in carry-sized parts that the
device prelude gathers back, checked, into whole wheels."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from bench import lockfile
from bench.lib import device_env, packages

ROOT = Path(__file__).resolve().parents[2]
# imported by diffusers and transformers only because installed: ~2 s of every start (never in the image)
NOT_SERVED = ("scipy", "scikit-learn", "pandas", "torchvision", "onnxruntime", "peft", "kopf", "kubernetes")


def test_the_lock_pins_every_requirement_with_a_hash_and_nothing_a_serve_never_imports() -> None:
    pins = packages.read_lock()
    asked = [packages.canonical(re.split(r"[=<>~!\s]", line, maxsplit=1)[0])
             for line in lockfile.REQUIREMENTS.read_text().splitlines() if line and not line.startswith("#")]
    assert set(asked) <= set(pins), set(asked) - set(pins)
    assert pins["torch"] == lockfile.TORCH_LOCAL and pins["diffusers"] == "0.42.1"
    assert not set(NOT_SERVED) & set(pins)
    text = packages.LOCK.read_text()
    hashed = re.findall(r"^([a-z0-9-]+)==\S+ \\\n    --hash=sha256:[0-9a-f]{64}$", text, re.M)
    assert set(hashed) == set(pins) - {"torch"}  # torch comes from the torch index, its build's own pins


def test_the_wheels_for_a_device_leave_out_torch_and_what_it_already_holds() -> None:
    pins = packages.read_lock()
    lines = lockfile.pypi_lines({"numpy": pins["numpy"], "pillow": "0.0"})
    names = {line.split("==")[0] for line in lines if not line.startswith(" ")}
    assert "torch" not in names and "numpy" not in names and "pillow" in names
    assert all(line.startswith("    --hash=") for line in lines if line.startswith(" "))


def test_the_parts_of_a_wheel_set_gather_back_into_checked_wheels(tmp_path: Path) -> None:
    staging = tmp_path / "staging"
    staging.mkdir()
    blobs = {"big-1.0-py3-none-any.whl": bytes(range(256)) * 9, "small-1.0-py3-none-any.whl": b"x" * 300}
    for name, data in blobs.items():
        (staging / name).write_bytes(data)
    folders = lockfile.split_into_parts(staging, tmp_path / ".whl", part_bytes=1000)
    assert [f.name for f in folders] == [".whl", ".whl-2", ".whl-3"]
    assert all(sum(p.stat().st_size for p in f.glob("*.whl.*")) <= 1000 for f in folders)
    store = tmp_path / "store"
    assert device_env.gather(store, folders[:1]) == sorted(blobs)  # the other parts not carried yet
    assert device_env.gather(store, folders[1:]) == []  # a later call brings the rest
    for name, data in blobs.items():
        assert hashlib.sha256((store / name).read_bytes()).digest() == hashlib.sha256(data).digest()
    manifest = json.loads((folders[0] / "MANIFEST.json").read_text())
    assert manifest["parts"] == 3 and manifest["wheels"]["big-1.0-py3-none-any.whl"]["chunks"] == 3


def test_the_device_site_links_the_checkout_and_what_the_system_has(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    lock = tmp_path / "engine.lock"
    have = packages.installed()
    lock.write_text(f"pydantic=={have['pydantic']}\nnot-installed-here==1.0\n")
    got = device_env.prepare(site, lock)
    assert got["linked"] == [f"pydantic=={have['pydantic']}"] and got["missing"] == ["not-installed-here==1.0"]
    assert (site / "pydantic").is_symlink() and (site / "dlo" / "engine").resolve() == ROOT / "engine"
    assert (site / "bench").resolve() == ROOT / "bench"
