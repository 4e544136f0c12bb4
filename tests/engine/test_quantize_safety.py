"""`dlo quantize SRC DST` never deletes what it did not make: SRC equal to or inside `DST.partial`, a
`DST.partial` that another program made or another quantize is writing, are refused in one line
(exit 2) and left as they were; a killed run's marked `DST.partial` is taken over. Run through the
real command on a tiny model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dlo.delivery.owned import MARKER

DLO = Path(sys.executable).parent / "dlo"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("quantize-safety") / "tiny"
    made = subprocess.run([str(DLO), "make-tiny-model", str(out), "--family", "wan"], capture_output=True, text=True,
                          timeout=300)
    assert made.returncode == 0, made.stderr
    return out


def quantize(src: Path, dst: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(DLO), "quantize", str(src), str(dst), "--dtype", "fp8", "--no-progress"],
                          capture_output=True, text=True, timeout=300)


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def marker(pid: int) -> str:
    import socket

    return json.dumps({"made_by": "dlo quantize", "pid": pid, "host": socket.gethostname()})


def _layout(case: str, tiny: Path, tmp: Path) -> tuple[Path, Path, Path]:
    """(SRC, DST, the folder that must come through untouched) for each refused case."""
    dst = tmp / "out"
    partial = tmp / "out.partial"
    if case == "src-is-dst-partial":
        shutil.copytree(tiny, partial)
        return partial, dst, partial
    if case == "src-inside-dst-partial":
        shutil.copytree(tiny, partial / "model")
        return partial / "model", dst, partial
    src = tmp / "model"
    shutil.copytree(tiny, src)
    partial.mkdir()
    if case == "foreign-dst-partial":
        (partial / "notes.txt").write_text("not dlo's")
    else:  # "dst-partial-in-use": another quantize, alive, is writing it
        (partial / MARKER).write_text(marker(os.getpid()))
        (partial / "half.safetensors").write_bytes(b"\0" * 64)
    return src, dst, partial


@pytest.mark.parametrize("case", ["src-is-dst-partial", "src-inside-dst-partial", "foreign-dst-partial",
                                  "dst-partial-in-use"])
def test_quantize_refuses_to_delete_what_it_did_not_make(tiny, tmp_path, case):
    src, dst, kept = _layout(case, tiny, tmp_path)
    before = snapshot(kept)
    proc = quantize(src, dst)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("dlo quantize: ") and str(kept.resolve()) in lines[0], lines[0]
    assert snapshot(kept) == before and snapshot(src) == snapshot(tiny)
    assert not dst.exists()


def test_quantize_takes_over_a_killed_runs_marked_staging_folder(tiny, tmp_path):
    src = tmp_path / "model"
    shutil.copytree(tiny, src)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / MARKER).write_text(marker(int(dead.stdout)))  # its process is gone
    (partial / "half.safetensors").write_bytes(b"\0" * 64)
    proc = quantize(src, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert not partial.exists() and not (tmp_path / "out" / "half.safetensors").exists()
    assert not (tmp_path / "out" / MARKER).exists() and (tmp_path / "out" / "model_index.json").is_file()
    assert snapshot(src) == snapshot(tiny)
