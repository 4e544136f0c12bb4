"""The node agent's attacks of bench/reliability_attacks.py: one bad model folder, half-sent requests,
a folder name with a newline, `dlo warm` and `dlo plan` on hostile files. Each returns figures."""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

from bench.reliability_probe import Agent, Prober, close_all, dlo, get, one_line_error, open_sockets, samples, still_open, \
    wait_for

SCAN_WAIT_S = 40.0  # the agent scans every 10 s: several rounds


def _deep_tree(folder: Path, depth: int) -> None:
    """`depth` nested folders under `folder` (deeper than a recursive walk can go)."""
    cwd = os.getcwd()
    try:
        os.chdir(folder)
        for _ in range(depth):
            os.mkdir("d")
            os.chdir("d")
    finally:
        os.chdir(cwd)


def hostile_root(root: Path, model: Path) -> Path:
    """good1, good2 (copies of the tiny Wan pipeline), badcfg (its config's `architectures` an
    integer), deep (a 3,000-folder deep tree beside its transformer)."""
    models = root / "models"
    if models.exists():
        return models
    models.mkdir(parents=True)
    for name in ("good1", "good2", "badcfg", "deep"):
        shutil.copytree(model, models / name)
    (models / "badcfg" / "transformer" / "config.json").write_text(json.dumps({"architectures": 5}))
    _deep_tree(models / "deep" / "transformer", 3000)
    return models


def bad_folder(root: Path, model: Path) -> dict:
    """Item 1: what /profile and /metrics show for the good folders beside two bad ones."""
    models = hostile_root(root, model)
    log = root / "agent-scan.log"
    with Agent(models, log) as agent:
        def profiled() -> dict:
            return json.loads(get(agent.url + "/profile", timeout=5)[1] or b"{}")

        wait_for(lambda: len(profiled().get("models", {})) >= 2, SCAN_WAIT_S, poll_s=1.0)
        time.sleep(1.0)
        prof = profiled()
        text = get(agent.url + "/metrics", timeout=5)[1].decode()
    errors = {labels["model"]: labels["reason"] for labels, v in samples(text, "dlo_model_error") if v == 1}
    return {
        "profile_models": sorted(prof.get("models", {})),
        "profile_model_errors": sorted(prof.get("model_errors", {})),
        "good_folders_with_series": sorted({labels["model"] for labels, _ in samples(text, "dlo_model_bytes")}
                                           & {"good1", "good2"}),
        "flagged_broken": errors,
        "scan_failed_log_lines": sum(1 for line in log.read_text(errors="replace").splitlines()
                                     if "model scan failed" in line),
    }


HALF_HEAD = b"GET /metrics HTTP/1.1\r\nHost: x\r\n"  # the head never ends


def half_sent(root: Path, n: int, window_s: float = 20.0) -> dict:
    """Item 2: `n` connections that send half a request head and wait; /health meanwhile."""
    empty = root / "empty-models"
    empty.mkdir(exist_ok=True)
    with Agent(empty, root / f"agent-half-{n}.log") as agent:
        threads_before = agent.threads()
        # the flood from 127.0.0.1; the probes from it too and from 127.0.0.2, another client (the
        # kubelet's address is not the attacker's)
        with Prober(agent.url + "/health") as same, Prober(agent.url + "/health", source="127.0.0.2") as other:
            socks = open_sockets(agent.port, n, HALF_HEAD, connect_timeout=1.0)
            connected = len(socks)
            time.sleep(window_s)
            threads_during = agent.threads()
            held = still_open(socks)
            close_all(socks)
        recovered = wait_for(lambda: get(agent.url + "/health")[0] == 200, 60, poll_s=0.2)
    return {"connections": n, "connected": connected, "held_after_window": held, "window_s": window_s,
            "threads_before": threads_before, "threads_during": threads_during, "recovered": recovered,
            "same_address": same.figures(), "other_address": other.figures()}


def newline_name(root: Path, model: Path) -> dict:
    """Item 9: a broken folder whose name holds a newline: does its log line stay one line?"""
    models = root / "newline-models"
    if not models.exists():
        models.mkdir()
        bad = models / "bad\nmodel forged=1"
        shutil.copytree(model, bad)
        f = next((bad / "transformer").glob("*.safetensors"))
        f.write_bytes(f.read_bytes()[:100])  # truncated
    log = root / "agent-newline.log"
    with Agent(models, log):
        wait_for(lambda: "model broken" in log.read_text(errors="replace"), SCAN_WAIT_S, poll_s=0.5)
    lines = log.read_text(errors="replace").splitlines()
    broken = [i for i, line in enumerate(lines) if "model broken" in line]
    split = bool(broken) and broken[0] + 1 < len(lines) and lines[broken[0] + 1].startswith("model forged=1")
    return {"logged": bool(broken), "line_split": split, "line": lines[broken[0]][-160:] if broken else ""}


def warm_and_plan(root: Path, model: Path) -> dict:
    """Items 1 and 9: `dlo warm` on a 0-byte file, a FIFO, the hostile folders; `dlo plan` on them
    and with a 23-digit --dp."""
    models = hostile_root(root, model)
    files = root / "warm-files"
    files.mkdir(exist_ok=True)
    empty = files / "empty.safetensors"
    empty.write_bytes(b"")
    fifo = files / "fifo.safetensors"
    if not fifo.exists():
        os.mkfifo(fifo)
    out = {
        "warm_zero_byte": one_line_error(dlo("warm", str(empty), timeout=60)),
        "warm_fifo": one_line_error(dlo("warm", str(fifo), timeout=60)),
        "warm_deep": one_line_error(dlo("warm", str(models / "deep"), timeout=60)),
        "plan_badcfg": one_line_error(dlo("plan", "--model", str(models / "badcfg"), timeout=60)),
        "plan_deep": one_line_error(dlo("plan", "--model", str(models / "deep"), timeout=60)),
        "plan_huge_dp": one_line_error(dlo("plan", "--model", str(models / "good1"), "--dp",
                                           "99999999999999999999999", timeout=60)),
    }
    return out


def run(root: Path, model: Path) -> dict:
    socket.setdefaulttimeout(None)
    return {
        "agent_bad_folder": bad_folder(root, model),
        "agent_half_sent_300": half_sent(root, 300),
        "agent_half_sent_1000": half_sent(root, 1000),
        "agent_newline_name": newline_name(root, model),
        "warm_and_plan": warm_and_plan(root, model),
    }
