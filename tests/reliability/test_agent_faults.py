"""Agent faults: unreadable cgroup files and directories, cgroup v1 and v2, processes exiting
mid-scan, missing files. The agent never crashes; what it cannot read is unknown (the series is
left out), never a wrong number.

Permission errors are real EACCES: the fixture trees are copied somewhere an unprivileged user can
traverse, parts are made unreadable, and the scan runs with that user's effective uid (root reads
every file whatever its mode). The v1 fixture tree was captured on a cgroup-v1 host; the v2 tree
follows the kernel's cgroup-v2 documentation.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dlo.agent.collector import make_registry
from dlo.agent.memory import CgroupFS, ProcFS, snapshot
from dlo.agent.node import Agent, AgentConfig
from dlo.plan.profile import Accelerator
from dlo.agent.topology import Devices

FIXTURES = Path(__file__).resolve().parents[1] / "agent" / "fixtures"
V1, V2 = FIXTURES / "v1", FIXTURES / "v2"
V1_POD_A = "0f5e1c2a-7d1b-4c55-9a53-1f2e3d4c5b6a"
V1_POD_A_DIR = f"kubepods/burstable/pod{V1_POD_A}"
V2_POD_A = "1a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"
V2_POD_A_DIR = f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{V2_POD_A.replace('-', '_')}.slice"
V2_POD_B = "6f5e4d3c-2b1a-4f9e-8d7c-6b5a4f3e2d1c"
NOBODY = 65534
CPU_ONLY = Devices(Accelerator(vendor="none", model="", count=0, memory_bytes=0), "none", None)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching to an unprivileged uid needs root")


@contextlib.contextmanager
def host_copy(version: Path) -> Iterator[Path]:
    """A private copy of a fixture host (proc/ and cgroup/) that uid nobody can traverse."""
    root = Path(tempfile.mkdtemp(prefix="dlo-faults-"))
    try:
        root.chmod(0o755)
        for sub in ("proc", "cgroup"):
            shutil.copytree(version / sub, root / sub)
        yield root
    finally:
        shutil.rmtree(root)


@contextlib.contextmanager
def as_nobody() -> Iterator[None]:
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def scrape(root: Path) -> dict[str, list[tuple[dict[str, str], float]]]:
    """One /metrics exposition of an agent over `root` (outside Kubernetes: pods labelled by uid)."""
    cfg = AgentConfig(node_name="n1", proc_root=root / "proc", cgroup_root=root / "cgroup")
    text = generate_latest(make_registry(Agent(cfg, devices=CPU_ONLY))).decode()
    return {f.name: [(s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(text)}


def pod_kinds(got: dict, pod: str) -> set[str]:
    return {labels["kind"] for labels, _ in got["dlo_pod_cgroup_memory_bytes"] if labels["pod"] == pod}


# --- unreadable files and directories --------------------------------------------------------


@needs_root
@pytest.mark.parametrize(
    "version, pod, qos_dir",
    [(V1, V1_POD_A, "memory/kubepods/burstable"), (V2, V2_POD_A, "kubepods.slice/kubepods-burstable.slice")],
    ids=["v1", "v2"],
)
def test_unsearchable_cgroup_directory_leaves_its_pods_series_out_and_the_scrape_goes_on(version, pod, qos_dir):
    with host_copy(version) as root:
        before = scrape(root)
        assert pod_kinds(before, pod) >= {"usage", "anon"}
        # The pod's QoS-class directory, root-owned 0700: nobody may not even stat the pod's cgroup.
        (root / "cgroup" / qos_dir).chmod(0o700)
        with as_nobody():
            after = scrape(root)
    assert pod_kinds(after, pod) == set()  # unknown, not zero
    assert any(labels["pod"] == pod for labels, _ in after["dlo_pod_pss_bytes"])  # its PSS still counts
    assert after["dlo_node_memory_bytes"] == before["dlo_node_memory_bytes"]
    others = {labels["pod"] for labels, _ in after["dlo_pod_cgroup_memory_bytes"]}
    assert others == {labels["pod"] for labels, _ in before["dlo_pod_cgroup_memory_bytes"]} - {pod}


@needs_root
@pytest.mark.parametrize(
    "version, rel, unreadable, unknown, known",
    [
        (V1, V1_POD_A_DIR, "memory.stat", {"anon", "file", "shmem", "file_mapped"}, {"usage", "peak", "kernel"}),
        (V1, V1_POD_A_DIR, "memory.usage_in_bytes", {"usage"}, {"anon", "peak"}),
        (V2, V2_POD_A_DIR, "memory.stat", {"anon", "file", "shmem", "file_mapped", "kernel"}, {"usage", "peak"}),
        (V2, V2_POD_A_DIR, "memory.current", {"usage"}, {"anon", "kernel"}),
    ],
    ids=["v1-stat", "v1-usage", "v2-stat", "v2-current"],
)
def test_unreadable_cgroup_file_makes_only_its_kinds_unknown(version, rel, unreadable, unknown, known):
    sub = "memory/" if version == V1 else ""
    with host_copy(version) as root:
        (root / "cgroup" / f"{sub}{rel}" / unreadable).chmod(0)
        with as_nobody():
            m = CgroupFS(root / "cgroup").read("/" + rel)
    assert m is not None and m.version == (1 if version == V1 else 2)
    assert {k for k in unknown if m.get(k) is None} == unknown
    assert all(m.get(k) is not None for k in known)


@needs_root
def test_v2_unreadable_top_level_cgroup_makes_the_invisible_estimate_unknown_not_inflated():
    with host_copy(V2) as root:
        assert snapshot(ProcFS(root / "proc"), CgroupFS(root / "cgroup")).cgroup_invisible_bytes == 5 << 30
        (root / "cgroup" / "system.slice" / "memory.current").chmod(0)
        with as_nobody():
            snap = snapshot(ProcFS(root / "proc"), CgroupFS(root / "cgroup"))
            got = scrape(root)
    # Leaving system.slice out of the sum would report its memory as cgroup-invisible.
    assert snap.cgroup_invisible_bytes is None
    assert got["dlo_node_cgroup_invisible_bytes"] == []
    assert got["dlo_node_memory_bytes"]


@needs_root
@pytest.mark.parametrize("version", [V1, V2], ids=["v1", "v2"])
def test_unsearchable_cgroup_root_means_no_cgroup_series_and_no_crash(version):
    with host_copy(version) as root:
        (root / "cgroup").chmod(0o700)
        with as_nobody():
            cg = CgroupFS(root / "cgroup")
            got = scrape(root)
    assert cg.version is None
    assert got["dlo_pod_cgroup_memory_bytes"] == [] and got["dlo_node_cgroup_invisible_bytes"] == []
    assert got["dlo_pod_pss_bytes"] and got["dlo_node_memory_bytes"]


@needs_root
def test_unreadable_proc_files_make_pss_and_node_memory_unknown():
    with host_copy(V2) as root:
        for pid in ("101", "102"):
            (root / "proc" / pid / "smaps_rollup").chmod(0)
        (root / "proc" / "meminfo").chmod(0)
        with as_nobody():
            got = scrape(root)
    assert V2_POD_A not in {labels["pod"] for labels, _ in got["dlo_pod_pss_bytes"]}
    assert V2_POD_B in {labels["pod"] for labels, _ in got["dlo_pod_pss_bytes"]}
    assert got["dlo_node_memory_bytes"] == [] and got["dlo_node_cgroup_invisible_bytes"] == []
    assert pod_kinds(got, V2_POD_A) >= {"usage", "anon"}  # the cgroup side is still read


# --- missing files ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", [V1, V2], ids=["v1", "v2"])
def test_pod_cgroup_removed_between_proc_scan_and_cgroup_read_is_unknown(version):
    pod, rel = (V1_POD_A, f"memory/{V1_POD_A_DIR}") if version == V1 else (V2_POD_A, V2_POD_A_DIR)
    with host_copy(version) as root:
        shutil.rmtree(root / "cgroup" / rel)  # the pod went away; its processes are still listed
        snap = snapshot(ProcFS(root / "proc"), CgroupFS(root / "cgroup"))
        got = scrape(root)
    assert snap.pods[pod].cgroup is None and snap.pods[pod].pss is not None
    assert pod_kinds(got, pod) == set()


def test_garbage_in_cgroup_files_is_unknown_not_an_error(tmp_path):
    root = tmp_path
    shutil.copytree(V2 / "cgroup", root / "cgroup")
    d = root / "cgroup" / V2_POD_A_DIR
    (d / "memory.current").write_text("not a number\n")
    (d / "memory.peak").write_text("")
    (d / "memory.stat").write_text("anon\nfile x\n\x00\x01 garbage\nshmem 4096\n")
    m = CgroupFS(root / "cgroup").read("/" + V2_POD_A_DIR)
    assert m is not None
    assert (m.get("usage"), m.get("peak"), m.get("anon"), m.get("file")) == (None, None, None, None)
    assert m.get("shmem") == 4096


# --- processes exiting mid-scan (live /proc) -------------------------------------------------


def test_process_exiting_between_status_and_smaps_rollup_reads_as_unknown_pss():
    # A zombie still has /proc/<pid>/status but smaps_rollup answers ESRCH: the exact state of a
    # process that exits after the scan read its status.
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while "State:\tZ" not in (Path(f"/proc/{child.pid}/status").read_text()):
        assert time.monotonic() < deadline, "child never became a zombie"
        time.sleep(0.01)
    try:
        p = ProcFS(Path("/proc")).process(child.pid)
        assert p is not None and p.pid == child.pid
        assert p.pss is None and p.rss is None
    finally:
        child.wait()
    assert ProcFS(Path("/proc")).process(child.pid) is None  # reaped: gone


def test_scans_of_the_live_host_survive_process_churn():
    """Scan the real /proc and this host's cgroup tree while processes start and exit under it."""
    stop = threading.Event()
    spawned = 0

    def churn() -> None:
        nonlocal spawned
        while not stop.is_set():
            procs = [subprocess.Popen(["sleep", "0.01"]) for _ in range(8)]
            for p in procs:
                p.wait()
            spawned += len(procs)

    proc, cgroups = ProcFS(Path("/proc")), CgroupFS(Path("/sys/fs/cgroup"))
    t = threading.Thread(target=churn, daemon=True)
    t.start()
    scans, started = 0, time.monotonic()
    try:
        while time.monotonic() - started < 3.0:
            snap = snapshot(proc, cgroups)  # must never raise
            assert snap.node["total"] is not None and snap.node["total"] > 0
            scans += 1
    finally:
        stop.set()
        t.join(timeout=10)
    assert scans >= 3 and spawned >= 50, (scans, spawned)
    print(f"FIGURE agent_churn cgroup_v{cgroups.version} scans={scans} processes_started_and_exited={spawned} seconds=3.0")
    if cgroups.version is not None:
        assert snapshot(proc, cgroups).cgroup_invisible_bytes is not None
