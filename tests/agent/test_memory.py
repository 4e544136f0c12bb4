"""dlo.agent.memory: cgroup v1 (captured on this host) and v2 (synthesised) trees, /proc, pods."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from dlo.agent.memory import (
    CgroupFS,
    ProcFS,
    memory_cgroup_of,
    node_memory,
    parse_kb_table,
    pod_of_cgroup,
    snapshot,
)

FIXTURES = Path(__file__).parent / "fixtures"
V1, V2 = FIXTURES / "v1", FIXTURES / "v2"
V1_POD_A = "0f5e1c2a-7d1b-4c55-9a53-1f2e3d4c5b6a"  # cgroupfs layout, 64 MiB anon, 16 MiB mlocked
V1_POD_B = "8c7d6e5f-4a3b-4c2d-8e1f-0a9b8c7d6e5f"  # systemd layout, maps a 32 MiB file it read first
V2_POD_A = "1a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"
V2_POD_B = "6f5e4d3c-2b1a-4f9e-8d7c-6b5a4f3e2d1c"
V2_POD_C = "aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee"
MiB = 1 << 20


def _stat_value(path: Path, key: str) -> int:
    for line in path.read_text().splitlines():
        k, v = line.split()
        if k == key:
            return int(v)
    raise KeyError(key)


# --- parsing of /proc/<pid>/cgroup and pod paths ---------------------------------------------


@pytest.mark.parametrize(
    "path, uid, cgroup",
    [
        (
            "/kubepods/burstable/pod0f5e1c2a-7d1b-4c55-9a53-1f2e3d4c5b6a/3b1f0c9d2e8a",
            V1_POD_A,
            "/kubepods/burstable/pod0f5e1c2a-7d1b-4c55-9a53-1f2e3d4c5b6a",
        ),
        (
            "/kubepods/pod0f5e1c2a-7d1b-4c55-9a53-1f2e3d4c5b6a/ctr",  # guaranteed QoS: no class level
            V1_POD_A,
            "/kubepods/pod0f5e1c2a-7d1b-4c55-9a53-1f2e3d4c5b6a",
        ),
        (
            "/kubepods.slice/kubepods-besteffort.slice/"
            "kubepods-besteffort-pod8c7d6e5f_4a3b_4c2d_8e1f_0a9b8c7d6e5f.slice/cri-containerd-9f.scope",
            V1_POD_B,
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod8c7d6e5f_4a3b_4c2d_8e1f_0a9b8c7d6e5f.slice",
        ),
        (
            # a reader in its own cgroup namespace sees the host path behind `..` components
            "/../../kubepods.slice/kubepods-pod8c7d6e5f_4a3b_4c2d_8e1f_0a9b8c7d6e5f.slice/crio-1.scope",
            V1_POD_B,
            "/kubepods.slice/kubepods-pod8c7d6e5f_4a3b_4c2d_8e1f_0a9b8c7d6e5f.slice",
        ),
    ],
    ids=["cgroupfs", "cgroupfs-guaranteed", "systemd", "cgroup-namespace"],
)
def test_pod_of_cgroup_for_kubelet_layouts(path: str, uid: str, cgroup: str) -> None:
    ref = pod_of_cgroup(path)
    assert ref is not None
    assert (ref.uid, ref.cgroup) == (uid, cgroup)


@pytest.mark.parametrize("path", ["/", "/system.slice/containerd.service", "/kubepods/burstable", "/user.slice/pod-ish"])
def test_non_pod_cgroups_have_no_pod(path: str) -> None:
    assert pod_of_cgroup(path) is None


def test_memory_cgroup_prefers_the_v1_memory_line_else_unified() -> None:
    hybrid = "9:name=systemd:/\n4:memory:/kubepods/x\n3:cpu,cpuacct:/y\n0::/\n"
    assert memory_cgroup_of(hybrid) == "/kubepods/x"
    assert memory_cgroup_of("0::/kubepods.slice/a.slice\n") == "/kubepods.slice/a.slice"
    assert memory_cgroup_of("garbage\n") is None


def test_kb_table_converts_kb_to_bytes_and_keeps_plain_numbers() -> None:
    t = parse_kb_table("Rss:   4 kB\nThreads:\t3\nName:\tpython\nbad line\n")
    assert t == {"Rss": 4096, "Threads": 3}


# --- cgroup v1, captured on this host -------------------------------------------------------


def test_v1_tree_is_detected_and_pod_a_reads_the_captured_counters() -> None:
    cg = CgroupFS(V1 / "cgroup")
    assert cg.version == 1
    d = V1 / "cgroup/memory/kubepods/burstable" / f"pod{V1_POD_A}"
    m = cg.read(f"/kubepods/burstable/pod{V1_POD_A}")
    assert m is not None and m.version == 1
    assert m.get("usage") == int((d / "memory.usage_in_bytes").read_text())
    assert m.get("peak") == int((d / "memory.max_usage_in_bytes").read_text())
    assert m.get("kernel") == int((d / "memory.kmem.usage_in_bytes").read_text())
    assert m.get("anon") == _stat_value(d / "memory.stat", "total_rss")
    # the capture allocated 64 MiB anonymous and mlocked 16 MiB of it
    assert 64 * MiB <= m.get("anon") < 72 * MiB
    assert m.get("unevictable") >= 16 * MiB
    assert m.get("file") == 0


def test_v1_first_reader_of_a_file_is_charged_its_page_cache() -> None:
    m = CgroupFS(V1 / "cgroup").read(
        "/kubepods.slice/kubepods-besteffort.slice/"
        f"kubepods-besteffort-pod{V1_POD_B.replace('-', '_')}.slice"
    )
    assert m is not None
    assert m.get("file") >= 32 * MiB
    assert m.get("file_mapped") >= 32 * MiB


def test_v1_snapshot_maps_processes_to_pods_with_pss() -> None:
    snap = snapshot(ProcFS(V1 / "proc"), CgroupFS(V1 / "cgroup"))
    assert set(snap.pods) == {V1_POD_A, V1_POD_B}
    pids = [int(p) for p in (V1 / "pids").read_text().split()]
    rollup = parse_kb_table((V1 / "proc" / str(pids[0]) / "smaps_rollup").read_text())
    assert snap.pods[V1_POD_A].pss == rollup["Pss"]
    assert snap.pods[V1_POD_A].processes == 1
    meminfo = parse_kb_table((V1 / "proc/meminfo").read_text())
    root_usage = int((V1 / "cgroup/memory/memory.usage_in_bytes").read_text())
    assert snap.cgroup_invisible_bytes == meminfo["MemTotal"] - meminfo["MemFree"] - root_usage
    assert snap.node["page_cache"] == meminfo["Cached"]


def test_v1_process_reads_vmlck_from_the_mlocking_capture() -> None:
    pids = [int(p) for p in (V1 / "pids").read_text().split()]
    p = ProcFS(V1 / "proc").process(pids[0])
    assert p is not None
    assert p.locked is not None and p.locked >= 16 * MiB
    assert p.pinned == 0


# --- cgroup v2, synthesised from the kernel documentation -------------------------------------


def test_v2_tree_is_detected_and_all_kinds_read() -> None:
    cg = CgroupFS(V2 / "cgroup")
    assert cg.version == 2
    m = cg.read(f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{V2_POD_A.replace('-', '_')}.slice")
    assert m is not None
    assert m.values == {
        "usage": 1500 * MiB, "peak": 1800 * MiB, "anon": 400 * MiB, "file": 1000 * MiB,
        "shmem": 16 * MiB, "file_mapped": 900 * MiB, "kernel": 40 * MiB, "unevictable": 64 * MiB,
    }


def test_v2_older_kernel_sums_kernel_parts_and_has_no_peak() -> None:
    m = CgroupFS(V2 / "cgroup").read(f"/kubepods/besteffort/pod{V2_POD_B}")
    assert m is not None
    assert m.get("peak") is None
    # kernel_stack 1 + pagetables 2 + percpu 1 + slab 4 MiB
    assert m.get("kernel") == 8 * MiB


def test_v2_snapshot_unknowns_and_invisible_estimate() -> None:
    snap = snapshot(ProcFS(V2 / "proc"), CgroupFS(V2 / "cgroup"))
    assert set(snap.pods) == {V2_POD_A, V2_POD_B, V2_POD_C}
    assert snap.pods[V2_POD_A].pss == (400_000 + 200_000) * 1024
    assert snap.pods[V2_POD_A].processes == 2
    # C: smaps_rollup unreadable -> PSS unknown; memory.stat unreadable -> kinds unknown
    c = snap.pods[V2_POD_C]
    assert c.pss is None and c.cgroup is not None
    assert c.cgroup.get("usage") == 10 * MiB and c.cgroup.get("anon") is None
    # used 8 GiB, top-level cgroups account for 3 GiB
    assert snap.cgroup_invisible_bytes == 5 * 1024 * MiB
    assert snap.node == node_memory(parse_kb_table((V2 / "proc/meminfo").read_text()))


# --- failure modes ---------------------------------------------------------------------------


def test_missing_roots_give_unknowns_not_errors(tmp_path: Path) -> None:
    cg = CgroupFS(tmp_path / "nothing")
    assert cg.version is None and cg.read("/kubepods") is None and cg.charged_bytes() is None
    snap = snapshot(ProcFS(tmp_path / "noproc"), cg)
    assert snap.pods == {} and snap.cgroup_invisible_bytes is None
    assert snap.node == {"total": None, "available": None, "page_cache": None, "mlocked": None}


def test_process_that_exits_mid_scan_is_skipped(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    shutil.copytree(V2 / "proc", root)
    shutil.rmtree(root / "102")  # gone between listing and reading
    proc = ProcFS(root)
    assert proc.process(102) is None
    assert proc.process(302) is None  # directory without files
    assert {p.pid for p in proc.processes()} == {1, 101, 201, 301}


def test_permission_denied_is_unknown() -> None:
    # A real EACCES: copy the tree somewhere an unprivileged user can traverse, make one file
    # unreadable, and read it as that user (root reads files whatever their mode).
    root = Path(tempfile.mkdtemp(prefix="dlo-perm-"))
    try:
        root.chmod(0o755)
        shutil.copytree(V2 / "proc", root / "proc")
        (root / "proc" / "101" / "smaps_rollup").chmod(0)
        if os.geteuid() == 0:
            os.setegid(65534)
            os.seteuid(65534)
        try:
            p = ProcFS(root / "proc").process(101)
        finally:
            if os.getuid() == 0:
                os.seteuid(0)
                os.setegid(0)
        assert p is not None
        assert p.pss is None  # smaps_rollup: permission denied
        assert p.locked == 1024 * 1024  # status still readable
    finally:
        shutil.rmtree(root)


def test_live_proc_reads_this_process() -> None:
    p = ProcFS(Path("/proc")).process(os.getpid())
    assert p is not None
    assert p.pss is not None and p.pss > 0
    assert p.rss is not None and p.rss >= p.pss_anon
    assert p.cgroup is not None
    assert ProcFS(Path("/proc")).meminfo()["MemTotal"] > 0
