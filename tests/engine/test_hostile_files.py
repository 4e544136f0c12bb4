"""Hostile adapter and checkpoint files against real `dlo` processes: each is refused in one line at
start (exit 2), never a hang, a traceback, black images or a refusal by every rank later - values
that are NaN, infinite or huge, an alpha that is huge, a rank above its layer, a `rank_pattern`
that backtracks without bound or is no regular expression, a FIFO named `*.safetensors`, a header
nested past the parser's stack, a header with `__metadata__` twice; and `dlo make-random-lora`
refuses a NaN alpha and a rank above its layers."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.engine.serving_helpers import offline_env, tiny_pipeline

pytestmark = pytest.mark.slow

MODULE = "blocks.0.attn1.to_out.0"  # a 32 x 32 linear layer of the tiny Wan transformer
DIM = 32
HANG_S = 120  # a process still running by then hangs (the bound of each run here)


def safetensors_bytes(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None,
                      header_text: str | None = None) -> bytes:
    """A safetensors file of float32 `tensors`; `header_text` replaces the header JSON as written."""
    header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    data, offset = b"", 0
    for name, array in tensors.items():
        raw = np.ascontiguousarray(array, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(raw)]}
        data, offset = data + raw, offset + len(raw)
    text = (header_text if header_text is not None else json.dumps(header)).encode()
    return struct.pack("<Q", len(text)) + text + data


def adapter(rank: int = 4, poison: float | None = None, config: dict | None = None) -> dict[str, np.ndarray | dict]:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((rank, DIM)).astype(np.float32) * 0.1
    if poison is not None:
        a[0, 0] = poison
    b = rng.standard_normal((DIM, rank)).astype(np.float32) * 0.01
    tensors = {f"transformer.{MODULE}.lora_A.weight": a, f"transformer.{MODULE}.lora_B.weight": b}
    meta = {"lora_adapter_metadata": json.dumps({f"transformer.{k}": v for k, v in config.items()})} if config else None
    return {"tensors": tensors, "metadata": meta}


def _duplicate_metadata() -> bytes:
    plain = adapter()
    good = safetensors_bytes(plain["tensors"])
    header = json.loads(good[8:8 + struct.unpack("<Q", good[:8])[0]])
    body = json.dumps(header)[1:]  # the same tensors, after two __metadata__ objects
    text = '{"__metadata__": {"a": "1"}, "__metadata__": {"a": "2"}, ' + body
    return safetensors_bytes(plain["tensors"], header_text=text)


def _file(case: str) -> bytes | None:
    """The adapter file of `case` (None: a FIFO)."""
    if case in ("nan", "inf", "huge-value"):
        return safetensors_bytes(**adapter(poison={"nan": float("nan"), "inf": float("inf"), "huge-value": 1e6}[case]))
    if case == "huge-alpha":
        return safetensors_bytes(**adapter(config={"r": 4, "lora_alpha": 1e12}))
    if case == "rank-above-layer":
        return safetensors_bytes(**adapter(rank=DIM + 1))
    if case == "backtracking-pattern":
        return safetensors_bytes(**adapter(config={"r": 4, "lora_alpha": 4, "rank_pattern": {r"(((\w|\.)+)+)+!": 8}}))
    if case == "invalid-pattern":
        return safetensors_bytes(**adapter(config={"r": 4, "lora_alpha": 4, "rank_pattern": {"(": 8}}))
    if case == "deep-header":
        return safetensors_bytes({}, header_text='{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    if case == "duplicate-metadata":
        return _duplicate_metadata()
    return None


# case -> words the one-line refusal holds
ADAPTERS = {
    "nan": "NaN or infinite", "inf": "NaN or infinite", "huge-value": "beyond ±1000",
    "huge-alpha": "beyond ±10000", "rank-above-layer": "exceeds the layer's 32 inputs",
    "backtracking-pattern": "backtracks without bound", "invalid-pattern": "is not a regular expression",
    "fifo": "a FIFO, not a regular file", "deep-header": "nests too deeply",
    "duplicate-metadata": "'__metadata__' appears twice",
}


def run_dlo(*argv: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "dlo.cli.main", *argv], capture_output=True, text=True,
                              env=offline_env(), timeout=HANG_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"dlo {argv[0]} still ran after {HANG_S} s (it hangs)")


def refused_in_one_line(proc: subprocess.CompletedProcess, prefix: str, words: str) -> str:
    """The one line `prefix...` naming `words` (log lines aside: `dlo warm` logs what it warmed)."""
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and " INFO " not in ln]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(prefix) and words in lines[0], proc.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("case", sorted(ADAPTERS))
def test_a_hostile_adapter_is_refused_at_start_in_one_line(tmp_path_factory, tmp_path, case):
    model = tiny_pipeline(tmp_path_factory, "wan")
    loras = tmp_path / "loras"
    loras.mkdir()
    data = _file(case)
    if data is None:
        os.mkfifo(loras / "hostile.safetensors")
    else:
        (loras / "hostile.safetensors").write_bytes(data)
    proc = run_dlo("serve", str(model), "--device", "cpu", "--lora-dir", str(loras), "--port", "0")
    line = refused_in_one_line(proc, "dlo serve: --lora-dir: ", ADAPTERS[case])
    assert proc.returncode == 2 and str(loras / "hostile.safetensors") in line, line


@pytest.fixture(scope="module")
def hostile_model(tmp_path_factory) -> Path:
    """The tiny Wan pipeline, its transformer's weights replaced by a header nested 100,000 deep."""
    model = tmp_path_factory.mktemp("hostile") / "model"
    shutil.copytree(tiny_pipeline(tmp_path_factory, "wan"), model)
    (model / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(_file("deep-header"))  # type: ignore[arg-type]
    return model


@pytest.mark.parametrize("command", ["serve", "quantize", "warm", "plan"])
def test_a_deeply_nested_checkpoint_header_is_one_line_in_every_command(hostile_model, tmp_path, command):
    weights = hostile_model / "transformer" / "diffusion_pytorch_model.safetensors"
    argv = {"serve": ["serve", str(hostile_model), "--device", "cpu", "--port", "0"],
            "quantize": ["quantize", str(hostile_model), str(tmp_path / "fp8"), "--dtype", "fp8"],
            "warm": ["warm", str(weights)],
            "plan": ["plan", "--model", str(hostile_model)]}[command]
    refused_in_one_line(run_dlo(*argv), f"dlo {command}", "nests too deeply")


def test_a_fifo_named_like_a_checkpoint_in_a_model_is_refused_at_once(tmp_path_factory, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_pipeline(tmp_path_factory, "wan"), model)
    os.mkfifo(model / "transformer" / "extra.safetensors")
    refused_in_one_line(run_dlo("serve", str(model), "--device", "cpu", "--port", "0"), "dlo serve", "a FIFO")


@pytest.mark.parametrize("argv, words", [(["--rank", "4", "--alpha", "nan"], "--alpha nan must be a finite number"),
                                         (["--rank", "1000000000"], "--rank 1000000000 exceeds 32")])
def test_make_random_lora_refuses_a_nan_alpha_and_a_rank_above_its_layers(tmp_path_factory, tmp_path, argv, words):
    model = tiny_pipeline(tmp_path_factory, "wan")
    proc = run_dlo("make-random-lora", str(model), str(tmp_path / "out"), *argv)
    assert proc.returncode == 2
    refused_in_one_line(proc, "dlo make-random-lora: ", words)
    assert not (tmp_path / "out" / "pytorch_lora_weights.safetensors").exists()
