"""Safetensors parsing and validation: every malformed input is a CheckpointError naming file and key."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from dlo.agent.memory import parse_kb_table
from dlo.engine.checkpoint import Checkpoint, CheckpointError, read_header


def write_raw(path: Path, header: dict | bytes, data: bytes = b"") -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


@pytest.fixture
def good(tmp_path) -> Path:
    p = tmp_path / "m.safetensors"
    save_file({"a.weight": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}, p)
    return p


def test_good_file_parses_with_absolute_ranges_and_zero_copy_views(good):
    ck = Checkpoint(good)
    assert set(ck.tensors) == {"a.weight", "b"}
    a = ck.view("a.weight")
    assert torch.equal(a, torch.arange(6, dtype=torch.float32).view(2, 3))
    # the view points into the shared mapping, not a private copy
    base = ck.file_bytes(good).data_ptr()
    assert base <= a.data_ptr() < base + good.stat().st_size
    assert ck.nbytes == 6 * 4 + 4 * 2


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda p: p.write_bytes(b"\x01\x02"), "truncated file"),
        (lambda p: p.write_bytes(struct.pack("<Q", 1000) + b"{}"), "runs past the end"),
        (lambda p: write_raw(p, b"{not json"), "not valid UTF-8 JSON"),
        (lambda p: write_raw(p, b"[1, 2]"), "must be a JSON object"),
        (lambda p: write_raw(p, {"x": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "unknown dtype"),
        (lambda p: write_raw(p, {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4), "outside the data section"),
        (lambda p: write_raw(p, {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4), "needs 8"),
        (lambda p: write_raw(p, {"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4), "non-negative"),
        (
            lambda p: write_raw(
                p,
                {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                 "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
                b"\0" * 12,
            ),
            "overlaps",
        ),
        (lambda p: write_raw(p, {"__metadata__": {"a": 1}}), "__metadata__"),
    ],
)
def test_malformed_file_raises_checkpoint_error_naming_file(tmp_path, build, message):
    p = tmp_path / "bad.safetensors"
    build(p)
    with pytest.raises(CheckpointError, match=message) as err:
        Checkpoint(p)
    assert str(p) in str(err.value)


def test_entry_error_names_the_key(tmp_path):
    p = write_raw(tmp_path / "k.safetensors", {"blocks.0.w": {"dtype": "XX", "shape": [1], "data_offsets": [0, 1]}}, b"\0")
    with pytest.raises(CheckpointError) as err:
        read_header(p)
    assert err.value.key == "blocks.0.w" and "blocks.0.w" in str(err.value)


def _index(tmp_path: Path, weight_map: dict) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_index_missing_shard_file(tmp_path):
    save_file({"a": torch.ones(2)}, tmp_path / "part-1.safetensors")
    _index(tmp_path, {"a": "part-1.safetensors", "b": "part-2.safetensors"})
    with pytest.raises(CheckpointError, match="shard file named in the index is missing") as err:
        Checkpoint(tmp_path)
    assert "part-2.safetensors" in str(err.value) and "[b]" in str(err.value)


def test_index_key_not_in_file_and_file_key_not_in_index(tmp_path):
    save_file({"a": torch.ones(2), "extra": torch.ones(1)}, tmp_path / "p.safetensors")
    _index(tmp_path, {"a": "p.safetensors"})
    with pytest.raises(CheckpointError, match="not listed in the index") as err:
        Checkpoint(tmp_path)
    assert "[extra]" in str(err.value)
    _index(tmp_path, {"a": "p.safetensors", "extra": "p.safetensors", "ghost": "p.safetensors"})
    with pytest.raises(CheckpointError, match=r"not in this file.*|.*\[ghost\]"):
        Checkpoint(tmp_path)


def test_index_may_not_point_outside_the_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    save_file({"a": torch.ones(2)}, tmp_path / "outside.safetensors")
    _index(tmp_path / "sub", {"a": "../outside.safetensors"})
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        Checkpoint(tmp_path / "sub")


def test_validate_missing_unexpected_shape_dtype(good):
    ck = Checkpoint(good)
    ok = {"a.weight": ((2, 3), ["F32"]), "b": ((4,), ["BF16"])}
    ck.validate(ok)
    with pytest.raises(CheckpointError, match=r"missing key.*|.*\[c\]"):
        ck.validate({**ok, "c": ((1,), ["F32"])})
    with pytest.raises(CheckpointError, match="unexpected key") as err:
        ck.validate({"a.weight": ok["a.weight"]})
    assert "[b]" in str(err.value) and str(good) in str(err.value)
    with pytest.raises(CheckpointError, match=r"shape \[2, 3\], the model expects \[3, 2\]"):
        ck.validate({**ok, "a.weight": ((3, 2), ["F32"])})
    with pytest.raises(CheckpointError, match="dtype BF16, the model expects F16"):
        ck.validate({**ok, "b": ((4,), ["F16"])})


def test_load_refuses_wrong_shape_and_dtype_naming_key(tmp_path):
    from dlo.engine import OffloadSettings, load
    from dlo.engine.families.tiny import make_tiny_transformer

    path = make_tiny_transformer(tmp_path / "t", "wan", layers=2)
    f = path / "diffusion_pytorch_model.safetensors"
    from safetensors.torch import load_file

    sd = load_file(f)
    key = "blocks.1.attn1.to_q.weight"
    sd[key] = sd[key][:, :-1].contiguous()
    save_file(sd, f)
    with pytest.raises(CheckpointError, match="shape") as err:
        load(path, settings=OffloadSettings("rank-local"), device="cpu")
    assert key in str(err.value)
    sd = load_file(f)
    sd[key] = torch.zeros(32, 32, dtype=torch.int32)
    save_file(sd, f)
    with pytest.raises(CheckpointError, match="dtype I32") as err:
        load(path, settings=OffloadSettings("rank-local"), device="cpu")
    assert key in str(err.value)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_corruption_is_checkpoint_error_or_success(tmp_path, good, data):
    raw = bytearray(good.read_bytes())
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    p = tmp_path / "fuzz.safetensors"
    p.write_bytes(bytes(raw))
    try:
        ck = Checkpoint(p)
    except CheckpointError:
        return
    for name in ck.tensors:  # whatever parsed must be viewable inside the file
        ck.view(name).sum()


def _map_and_report(path: str, barrier, out) -> None:
    ck = Checkpoint(path)
    before = _rollup()
    total = sum(float(ck.view(n).float().sum()) for n in ck.tensors)  # touch every page
    barrier.wait()  # both processes map the file now
    after = _rollup()
    barrier.wait()
    out.put((before, after, total))


def _rollup() -> dict[str, int]:
    return parse_kb_table(Path("/proc/self/smaps_rollup").read_text())


@pytest.mark.slow
def test_two_processes_share_one_page_cache_copy(tmp_path):
    p = tmp_path / "big.safetensors"
    n = 64 * 1024 * 1024 // 4
    save_file({f"t{i}": torch.rand(n // 4) for i in range(4)}, p)
    os.sync()  # a freshly written file shows as Private_Dirty until synced
    size = p.stat().st_size
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_map_and_report, args=(str(p), barrier, out)) for _ in range(2)]
    for pr in procs:
        pr.start()
    results = [out.get(timeout=120) for _ in procs]
    for pr in procs:
        pr.join(60)
    for before, after, _ in results:
        pss_file = after["Pss_File"] - before["Pss_File"]
        anon = after["Pss_Anon"] - before["Pss_Anon"]
        # each of two mappers is charged about half of the file, and no private copy appears
        assert 0.4 * size < pss_file < 0.6 * size, (pss_file, size)
        assert anon < 16 * 1024 * 1024, anon


def test_a_folder_is_parsed_once_per_process_until_its_files_change(tmp_path, monkeypatch):
    import dlo.engine.checkpoint as checkpoint
    from dlo.engine.blocks import describe
    from dlo.engine.families.tiny import make_tiny_transformer

    path = make_tiny_transformer(tmp_path / "t", "wan", layers=2)
    parsed = []
    real = checkpoint.read_header
    monkeypatch.setattr(checkpoint, "read_header", lambda p: parsed.append(p) or real(p))
    first = checkpoint.cached_checkpoint(path)
    describe(path)
    again = checkpoint.cached_checkpoint(str(path))
    assert len(parsed) == 1 and again.tensors is first.tensors  # one parse, shared
    # ... but each caller owns its mappings: closing one never breaks another's views, and nothing
    # stays mapped in the process once the callers are gone.
    name = next(iter(first.tensors))
    view = again.view(name).clone()
    first.view(name)
    first.close()
    assert again.view(name).equal(view) and not first._maps and again._maps
    f = next(path.glob("*.safetensors"))
    f.write_bytes(f.read_bytes())  # same bytes, a new modification: parsed again
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 1_000_000))
    assert checkpoint.cached_checkpoint(path).tensors is not first.tensors and len(parsed) == 2


def test_one_config_reader_names_the_file(tmp_path):
    from dlo.engine.checkpoint import CheckpointError, read_json_config

    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="config.json"):
        read_json_config(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="unreadable"):
        read_json_config(tmp_path / "missing.json")
