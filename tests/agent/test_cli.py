"""dlo.agent.cli: `dlo plan`, `dlo warm` and `dlo agent` as a user runs them (real subprocesses)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dlo.plan.policy import choose_mode
from dlo.plan.profile import NodeProfile
from dlo.engine.blocks import describe

ROOT = Path(__file__).resolve().parents[2]
GB = 1_000_000_000
PROFILE = {
    "version": "v1", "node": "gpu-1",
    "accelerator": {"vendor": "nvidia", "model": "test", "count": 8, "memory_bytes": 48 * GB},
    "interconnect": {"kind": "nvlink", "collective_bandwidth_bps": 400 * GB},
    "h2d_bandwidth_bps": 55 * GB, "host_memory_bytes": 2000 * GB, "can_register_page_cache": False,
}
ESTIMATE_KEYS = {"pinned_host_bytes", "page_cache_bytes", "cold_start_peak_bytes", "device_weight_bytes",
                 "block_seconds", "fits", "device_peak_bytes"}


def dlo(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dlo.cli.main", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    f = tmp_path / "profile.json"
    f.write_text(json.dumps(PROFILE))
    return f


def test_plan_json_shape_for_byte_counts(profile_file: Path) -> None:
    r = dlo("plan", "--model-bytes", str(60 * GB), "--max-block-bytes", str(1_200_000_000), "--dp", "8",
            "--block-compute-seconds", "0.003", "--profile", str(profile_file), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert set(doc) == {"choice", "modes", "device_budget_bytes", "plan"}
    assert doc["choice"]["mode"] == "allgather" and doc["choice"]["reason"]
    plan = doc["plan"]  # the deployment plan `dlo serve` would run on this node (dlo.plan.deployment)
    assert plan["mode"] == "allgather" and plan["dp"] == 8 and plan["budget_bytes"] == doc["device_budget_bytes"]
    assert plan["limits"] is None and plan["predicted_peak_bytes"] == {}  # byte counts: no pipeline
    assert any(r.startswith("mode allgather: policy: ") for r in plan["reasons"])
    assert set(doc["modes"]) == {"allgather", "rank_local", "resident"}
    assert all(set(v) == ESTIMATE_KEYS for v in doc["modes"].values())
    assert doc["modes"]["rank_local"]["pinned_host_bytes"] == 8 * 60 * GB


def test_plan_of_a_model_folder_uses_its_facts(models_root: Path, profile_file: Path) -> None:
    folder = models_root / "tiny-wan"
    r = dlo("plan", "--model", str(folder), "--dp", "2", "--profile", str(profile_file), "--json")
    assert r.returncode == 0, r.stderr
    facts = describe(folder)
    expected = choose_mode(NodeProfile.model_validate(PROFILE), facts, dp=2)
    doc = json.loads(r.stdout)
    assert {k: v for k, v in doc.items() if k != "plan"} == json.loads(json.dumps(expected.plan_json()))
    assert doc["plan"]["mode"] == expected.engine_mode  # a transformer folder: no limits, no pipeline
    assert json.loads(r.stdout)["modes"]["resident"]["device_weight_bytes"] == facts.bytes


def test_plan_without_a_profile_detects_this_machine(models_root: Path, tmp_path: Path) -> None:
    # No accelerator here: the detected profile budgets device weights in host RAM, and the
    # calibration fragment supplies the bandwidths nothing nominal gives a CPU.
    frag = tmp_path / "calibration.json"
    frag.write_text(json.dumps({"h2d_bandwidth_bps": 10**10, "collective_bandwidth_bps": 10**9}))
    r = dlo("plan", "--model", str(models_root / "tiny-wan"), "--dp", "2", "--calibration", str(frag), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["choice"]["mode"] == "resident"


def test_plan_table_names_the_choice(profile_file: Path) -> None:
    r = dlo("plan", "--model-bytes", str(60 * GB), "--max-block-bytes", str(1_200_000_000), "--dp", "8",
            "--block-compute-seconds", "0.025", "--profile", str(profile_file))
    assert r.returncode == 0, r.stderr
    assert "choice: rank-local" in r.stdout
    for mode in ("allgather", "rank-local", "resident"):
        assert mode in r.stdout


def test_plan_host_memory_override_changes_the_choice(profile_file: Path) -> None:
    r = dlo("plan", "--model-bytes", str(60 * GB), "--max-block-bytes", str(1_200_000_000), "--dp", "8",
            "--block-compute-seconds", "0.025", "--profile", str(profile_file),
            "--host-memory-bytes", str(256 * GB), "--json")
    assert json.loads(r.stdout)["choice"]["mode"] == "allgather"


def test_plan_nothing_fits_exits_1_with_estimates(profile_file: Path) -> None:
    r = dlo("plan", "--model-bytes", str(60 * GB), "--max-block-bytes", str(1_200_000_000), "--dp", "8",
            "--profile", str(profile_file), "--host-memory-bytes", str(50 * GB), "--json")
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert doc["choice"] is None and "no mode fits" in doc["error"]
    assert not any(m["fits"] for m in doc["modes"].values())


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model-bytes", "10"], "--max-block-bytes"),
        (["--model-bytes", "10", "--max-block-bytes", "1", "--tokens", "5", "--block-compute-seconds", "1"],
         "not allowed with"),
        ([], "required"),
    ],
)
def test_plan_argument_errors_exit_2(args: list[str], message: str) -> None:
    r = dlo("plan", *args)
    assert r.returncode == 2 and message in r.stderr


def test_plan_unreadable_profile_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "p.json"
    bad.write_text('{"version": "v9"}')
    r = dlo("plan", "--model-bytes", "10", "--max-block-bytes", "1", "--profile", str(bad))
    assert r.returncode == 2 and "version" in r.stderr


def test_warm_json_reports_residency_and_exits_0(models_root: Path) -> None:
    folder = models_root / "tiny-wan"
    for f in folder.rglob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    r = dlo("warm", str(folder), "--json", "--threshold", "0.99")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["ratio"] == 1.0 and len(doc["files"]) == 2
    assert all(f["ratio_before"] == 0.0 for f in doc["files"])


def test_warm_missing_path_exits_2(tmp_path: Path) -> None:
    r = dlo("warm", str(tmp_path / "nope"))
    assert r.returncode == 2 and "nope" in r.stderr


def test_warm_lock_holds_until_sigterm(models_root: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlo.cli.main", "warm", str(models_root / "tiny-wan"), "--lock"],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        if "holding the locked pages" in line:
            break
    status = Path(f"/proc/{proc.pid}/status").read_text()
    locked_kb = int(re.search(r"VmLck:\s+(\d+) kB", status).group(1))  # type: ignore[union-attr]
    files = sum(f.stat().st_size for f in (models_root / "tiny-wan").rglob("*.safetensors"))
    assert locked_kb * 1024 >= files
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0


@pytest.mark.parametrize("command, words", [
    ("plan", ["--model", "--tokens", "--profile", "--json"]),
    ("warm", ["--threshold", "--lock", "cgroup"]),
    ("agent", ["--proc-root", "--cgroup-root", "--engine-url", "dlo.dev/node-profile"]),
])
def test_help_explains_each_command(command: str, words: list[str]) -> None:
    r = dlo(command, "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for w in words:
        assert w in text


def test_agent_default_port_is_the_charts_not_dcgm_exporters() -> None:
    import yaml

    from dlo.agent.cli import DEFAULT_PORT, agent_parser

    chart_port = yaml.safe_load((ROOT / "charts/dlo/values.yaml").read_text())["agent"]["port"]
    assert agent_parser().parse_args([]).port == DEFAULT_PORT == chart_port == 9435
    r = dlo("agent", "--help")
    text = " ".join(r.stdout.split())
    assert "default 9435" in text and "9400" in text  # 9400 only where it says whose port that is
    assert "--port 9435" in text


def test_agent_command_serves_until_sigterm(models_root: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlo.cli.main", "agent", "--port", "0", "--host", "127.0.0.1",
         "--models-root", str(models_root), "--kubernetes", "off", "--node-name", "cli-node"],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
    )
    assert proc.stderr is not None
    try:
        port = None
        for line in proc.stderr:
            m = re.search(r"serving on http://127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        assert port
        # the node loop scans the models root next to the server: wait for its first scan to be in
        deadline = time.monotonic() + 30
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/profile", timeout=10) as r:
                p = NodeProfile.model_validate_json(r.read())
            if p.models or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert p.node == "cli-node" and "tiny-wan" in p.models
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert b'dlo_model_bytes{model="tiny-wan"}' in r.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def test_progress_lines_report_bytes_rate_and_eta() -> None:
    from dlo.agent.cli import _ProgressLines

    out: list[str] = []
    lines = _ProgressLines(4 * GB, out.append, every_s=0.0)
    lines.advance(GB)
    assert len(out) == 1 and out[0].startswith("warming 1.00 / 4.00 GB,")
    assert re.search(r"[\d.]+ GB/s, ETA \d+ s$", out[0])
    quiet = _ProgressLines(4 * GB, out.append, every_s=3600)
    quiet.advance(GB)
    assert len(out) == 1


CPU_PROFILE = {
    "version": "v1", "node": "cpu-1", "accelerator": {"vendor": "none", "count": 0, "memory_bytes": 0},
    "interconnect": {"kind": "none", "collective_bandwidth_bps": 0},
    "h2d_bandwidth_bps": 0, "host_memory_bytes": 400 * GB,
}
PLAN_60 = ["--model-bytes", str(60 * GB), "--max-block-bytes", str(1_200_000_000), "--dp", "8"]


def test_plan_without_bandwidth_answers_memory_and_fit_with_time_na(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps(CPU_PROFILE))
    r = dlo("plan", *PLAN_60, "--profile", str(cpu), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    modes = doc["modes"]
    # the memory model needs no bandwidth: every figure is there, and the fit is decided on memory
    assert modes["allgather"]["pinned_host_bytes"] == 60 * GB and modes["rank_local"]["pinned_host_bytes"] == 480 * GB
    assert (modes["allgather"]["fits"], modes["rank_local"]["fits"], modes["resident"]["fits"]) == (True, False, False)
    assert modes["allgather"]["block_seconds"] is None and modes["rank_local"]["block_seconds"] is None
    assert doc["choice"]["mode"] == "allgather"
    assert "no H2D bandwidth" in doc["choice"]["reason"] and "rank_local does not fit" in doc["choice"]["reason"]
    # accelerators without a bandwidth, both offload modes fit: allgather, the least memory, and the
    # reason says the times are unknown
    gpu = tmp_path / "gpu-without-bandwidth.json"
    gpu.write_text(json.dumps({**PROFILE, "h2d_bandwidth_bps": 0}))
    big = dlo("plan", *PLAN_60, "--profile", str(gpu), "--json")
    choice = json.loads(big.stdout)["choice"]
    assert big.returncode == 0 and choice["mode"] == "allgather"
    assert "both fit" in choice["reason"] and "no H2D bandwidth" in choice["reason"]
    # the table says n/a and why
    table = dlo("plan", *PLAN_60, "--profile", str(cpu))
    assert table.returncode == 0, table.stderr
    assert "n/a" in table.stdout and "no H2D bandwidth" in " ".join(table.stdout.split())
    assert "choice: allgather" in table.stdout


def test_plan_on_a_machine_without_accelerators_gives_a_memory_verdict() -> None:
    # The command: no profile, no accelerator. Memory and fit come out; only "nothing fits"
    # may exit 1, never the missing bandwidth.
    if Path("/dev/nvidiactl").exists():
        pytest.skip("this host has an NVIDIA driver: it has a nominal bandwidth")
    r = dlo("plan", *PLAN_60, "--host-memory-bytes", str(4000 * GB), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["modes"]["allgather"]["fits"] and doc["modes"]["allgather"]["block_seconds"] is None
    small = dlo("plan", *PLAN_60, "--host-memory-bytes", str(50 * GB))
    assert small.returncode == 1 and "no mode fits" in small.stderr and "h2d_bandwidth_bps" not in small.stderr
    assert "rank-local" in small.stdout  # the table is still printed


def test_plan_of_a_tiny_model_on_a_cpu_node_shows_its_sizes_and_says_why_figures_are_missing(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps(CPU_PROFILE))
    r = dlo("plan", "--model-bytes", "215552", "--max-block-bytes", "54016", "--profile", str(cpu))
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # rich wraps the notes at the console's width
    assert "model 0.2 MB" in text and "largest block 0.1 MB" in text and "no device" in text
    assert "host MB" in text and " 0.2 " in _plan_rows(r.stdout)[0] and " 0.0 GB" not in text
    assert "time per block n/a: the profile has no H2D bandwidth" in text
    assert "device peak n/a: the node has no accelerator" in text


def test_plan_with_a_typo_in_the_profile_names_the_key(tmp_path: Path) -> None:
    typo = tmp_path / "p.json"
    typo.write_text(json.dumps({**PROFILE, "can_register_pagecache": True}))
    r = dlo("plan", *PLAN_60, "--profile", str(typo))
    assert r.returncode == 2 and "unknown key 'can_register_pagecache'" in r.stderr
    assert "can_register_page_cache" in r.stderr  # the keys known there, to spot the typo
    assert r.stdout == ""


def _plan_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.strip().split(" ")[0] in ("allgather", "rank-local", "resident")]


@pytest.mark.parametrize("columns", [None, "80"], ids=["piped", "COLUMNS=80"])
@pytest.mark.parametrize("with_bandwidth", [True, False], ids=["timed", "no-bandwidth"])
def test_plan_table_keeps_mode_names_whole_when_piped_or_at_80_columns(
    tmp_path: Path, columns: str | None, with_bandwidth: bool
) -> None:
    f = tmp_path / "p.json"
    f.write_text(json.dumps(PROFILE if with_bandwidth else CPU_PROFILE))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    if columns:
        env["COLUMNS"] = columns
    r = subprocess.run(
        [sys.executable, "-m", "dlo.cli.main", "plan", *PLAN_60, "--host-memory-bytes", str(9000 * GB),
         "--block-compute-seconds", "0.004", "--profile", str(f)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env,
    )
    assert r.returncode == 0, r.stderr
    rows = _plan_rows(r.stdout)
    assert [row.split()[0] for row in rows] == ["allgather", "rank-local", "resident"]
    assert "…" not in r.stdout and "rank-loc…" not in r.stdout
    assert all(len(line) <= 80 for line in r.stdout.splitlines() if line in rows or "GB" in line)
    # every value is whole: 9,000.0 GB of host memory and 540.0 GB of cold-start peak (rank-local)
    assert "9,000.0" in r.stdout


def test_plan_table_keeps_mode_names_whole_in_an_80_column_terminal(profile_file: Path) -> None:
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlo.cli.main", "plan", *PLAN_60, "--block-compute-seconds", "0.004",
         "--profile", str(profile_file)],
        cwd=ROOT, stdout=follower, stderr=follower, env=env,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode())  # colours and styles
    rows = _plan_rows(text.replace("\r", ""))
    assert [row.split()[0] for row in rows] == ["allgather", "rank-local", "resident"]
    assert "…" not in text and all(len(row) <= 80 for row in rows)


def test_warm_refuses_a_zero_byte_file_a_fifo_and_a_tree_too_deep_in_one_line(tmp_path: Path, deep_tree) -> None:
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    deep = deep_tree(tmp_path / "deep")
    for path, words in ((empty, "truncated"), (fifo, "not a regular file"), (deep, "too deep")):
        r = dlo("warm", str(path))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        errors = [line for line in r.stderr.splitlines() if line.startswith("dlo warm:")]
        assert len(errors) == 1 and words in errors[0] and str(path) in errors[0], r.stderr


def test_plan_of_a_folder_whose_config_has_wrong_types_is_one_line(models_root: Path) -> None:
    (models_root / "tiny-wan" / "transformer" / "config.json").write_text(json.dumps({"architectures": 5}))
    r = dlo("plan", "--model", str(models_root / "tiny-wan"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "architectures" in r.stderr, r.stderr


def test_agent_log_lines_escape_a_newline_in_a_folder_name(tmp_path: Path) -> None:
    from .conftest import write_wan_folder

    root = tmp_path / "models"
    bad = write_wan_folder(root / "bad\nforged line")
    with open(bad / "transformer" / "diffusion_pytorch_model.safetensors", "r+b") as f:
        f.truncate(100)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dlo.cli.main", "agent", "--port", "0", "--models-root", str(root),
         "--kubernetes", "off"], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    try:
        lines = []
        for line in proc.stderr:  # both lines, in either order (the folder scan runs beside the server)
            lines.append(line)
            text = "".join(lines)
            if "model broken" in text and "serving on" in text:
                break
        assert "serving on http://127.0.0.1:" in "".join(lines)  # outside a cluster: loopback only
        broken = next(line for line in lines if "model broken" in line)
        assert "model=bad\\nforged line" in broken, broken
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


def test_plan_takes_the_device_budget_as_dlo_serve_does(profile_file: Path) -> None:
    one = ["--model-bytes", str(28 * GB), "--max-block-bytes", str(700_000_000), "--dp", "1",
           "--profile", str(profile_file)]
    assert json.loads(dlo("plan", *one, "--json").stdout)["choice"]["mode"] == "resident"  # 48 GB devices
    r = dlo("plan", *one, "--max-device-memory", "24GiB", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["choice"]["mode"] == "rank_local" and doc["device_budget_bytes"] == 24 * 2**30
    assert not doc["modes"]["resident"]["fits"]
    small = dlo("plan", *one, "--max-device-memory", "1GB")
    assert small.returncode == 1 and "smallest device budget that fits is 1.6 GB (rank-local)" in small.stderr
    assert "budget 1.0 GB" in small.stdout  # the table is printed, with the budget in its title


def test_plan_of_a_pipeline_with_no_limits_derives_them_as_dlo_serve_does(profile_file: Path, tmp_path_factory) -> None:
    """A pipeline folder and no --limits or --max-size: the plan `dlo serve` would start with (the limits
    derived from the budget, said in one line; the JSON's plan holds them); with --max-size: kept as given."""
    from tests.engine.serving_helpers import tiny_pipeline

    model = tiny_pipeline(tmp_path_factory, "wan")
    one = ["--model", str(model), "--dp", "1", "--profile", str(profile_file), "--max-device-memory", "8GiB"]
    r = dlo("plan", *one)
    assert r.returncode == 0, r.stderr
    assert "limits derived from the device budget: " in " ".join(r.stdout.split())
    doc = json.loads(dlo("plan", *one, "--json").stdout)["plan"]
    assert doc["limits"]["max_frames"] < 129 and doc["reasons"][0].startswith("limits derived")
    given = dlo("plan", *one, "--max-size", "1024", "--json")
    assert "limits derived" not in given.stdout
