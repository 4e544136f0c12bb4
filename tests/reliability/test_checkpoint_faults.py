"""Checkpoint faults at serve time: `dlo serve` (2 ranks) refuses a broken transformer checkpoint at
load with the `CheckpointError` message naming the file and the key, never reports ready, and
exits non-zero leaving no rank behind. Each case breaks a copy of the tiny pipeline in one way.
Faults in headers, index or shard files are refused before any rank starts; wrong dtypes and
shapes when the ranks build the model."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import requests

from dlo.serving.launch import ServerProcess
from tests.engine.serving_helpers import tiny_pipeline
from tests.reliability.figures import record
from tests.reliability.procs import survivors

pytestmark = pytest.mark.slow

FILE = "diffusion_pytorch_model.safetensors"
KEY = "blocks.0.attn1.to_q.weight"  # a block tensor of the tiny Wan transformer


def _header(path: Path) -> tuple[int, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return n, raw[8 : 8 + n]


def _rewrite(path: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def truncated(tdir: Path) -> tuple[Path, str]:
    path = tdir / FILE
    raw = path.read_bytes()
    path.write_bytes(raw[:-1])
    # the tensor stored last (and only it) no longer fits in the data section
    n, header = _header(path)
    last = max(((k, v) for k, v in json.loads(header).items() if k != "__metadata__"),
               key=lambda kv: kv[1]["data_offsets"][1])[0]
    return path, last


def flipped_header(tdir: Path) -> tuple[Path, str]:
    """One bit flipped in a digit of KEY's data_offsets: still valid JSON, now wrong."""
    path = tdir / FILE
    raw = bytearray(path.read_bytes())
    at = raw.index(f'"{KEY}"'.encode())
    m = re.compile(rb'"data_offsets":\[(\d+),(\d+)\]').search(bytes(raw), at)
    assert m is not None
    raw[m.end(2) - 1] ^= 0x01  # the last digit of the end offset: '0' <-> '1', '2' <-> '3', ...
    path.write_bytes(bytes(raw))
    return path, KEY


def shard_missing(tdir: Path) -> tuple[Path, str]:
    """Split into two shards with an index, then delete the second shard."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(tdir / FILE)
    (tdir / FILE).unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for fname, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, tdir / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    (tdir / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    gone = tdir / "model-00002-of-00002.safetensors"
    gone.unlink()
    return gone, halves[gone.name][0]


def wrong_dtype(tdir: Path) -> tuple[Path, str]:
    import torch

    _rewrite(tdir / FILE, lambda t: t.update({KEY: t[KEY].to(torch.float16)}))
    return tdir / FILE, KEY


def wrong_shape(tdir: Path) -> tuple[Path, str]:
    _rewrite(tdir / FILE, lambda t: t.update({KEY: t[KEY][:-1].contiguous()}))
    return tdir / FILE, KEY


FAULTS = {f.__name__: f for f in (truncated, flipped_header, shard_missing, wrong_dtype, wrong_shape)}
# Headers, index and shard files are checked before any rank starts (torch-free); dtypes and shapes
# need the model, so every rank refuses those at load.
REFUSED_BEFORE_RANKS = {"truncated", "flipped_header", "shard_missing"}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_broken_checkpoint_is_refused_at_load_naming_file_and_key(tmp_path_factory, tmp_path, fault):
    model = tmp_path / "model"
    shutil.copytree(tiny_pipeline(tmp_path_factory, "wan"), model)
    path, key = FAULTS[fault](model / "transformer")
    log = tmp_path / "serve.log"
    srv = ServerProcess(model, "--dp", "2", "--mode", "allgather", "--device", "cpu", "--small-limits", log_path=log)
    t0 = time.monotonic()
    with open(log, "wb") as out:
        srv.proc = subprocess.Popen(srv.cmd, env=srv.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        tree = [psutil.Process(srv.proc.pid)]
        readies: list[int] = []
        # child pid -> its latest command line: one caught between its fork and its exec still carries
        # its parent's (a rank then looks like the server, a rank's helper like the rank), so each poll
        # reads it again while the child lives
        seen: dict[int, str] = {}
        direct: set[int] = set()  # the server's own children (not a rank's helpers)
        reason = ""
        try:
            while srv.proc.poll() is None and time.monotonic() - t0 < 120:
                try:
                    for child in tree[0].children(recursive=True):
                        cmd = " ".join(child.cmdline())  # before the append: retried if it raced
                        seen[child.pid] = cmd or seen.get(child.pid, "")  # a zombie's reads empty: keep the last
                        if child not in tree:
                            if child.ppid() == srv.proc.pid:
                                direct.add(child.pid)
                            tree.append(child)
                    r = requests.get(srv.url + "/ready", timeout=5)
                    readies.append(r.status_code)
                    reason = r.json().get("reason") or reason
                except (requests.ConnectionError, psutil.Error):
                    pass
                time.sleep(0.05)
            code = srv.proc.wait(timeout=30)
        finally:
            srv.stop(timeout=5)
    seconds = time.monotonic() - t0
    text = log.read_text(errors="replace")
    assert code not in (0, None), f"dlo serve exited {code}\n{text[-3000:]}"
    assert 200 not in readies, "the server reported ready on a broken checkpoint"
    where = f"{path} [{key}]"
    assert "CheckpointError" in text and where in text, f"expected {where!r} in the log:\n{text[-3000:]}"
    if reason:  # /ready said why while it was still up
        assert where in reason, reason
    ranks = sum("dlo.serving.rank_main" in cmd for pid, cmd in seen.items() if pid in direct)  # not a helper
    if fault in REFUSED_BEFORE_RANKS:
        assert not seen and not readies, f"processes {seen} started or HTTP came up for a checkpoint refusable up front"
    else:
        assert ranks == 1, f"{ranks} child ranks seen, 1 expected: {seen}"
    assert not survivors(tree, 10), "a rank survived"
    message = next(line for line in text.splitlines() if where in line)
    record("checkpoint_fault", fault=fault, exit_code=code, ranks_started=1 + ranks, seconds_to_exit=round(seconds, 2),
           ready_polls=len(readies), ready_200=readies.count(200), message=message.strip()[-240:])
