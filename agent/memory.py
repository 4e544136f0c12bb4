"""Host-memory truth: cgroup v1/v2 memory, per-process PSS and pinned pages, `/proc/meminfo`.

Owns: reading what the kernel says about memory under configurable roots (`proc_root`, default
`/proc`; `cgroup_root`, default `/sys/fs/cgroup`), mapping processes to Kubernetes pod cgroups
through the pod UID in `/proc/<pid>/cgroup`, and the estimate of memory no cgroup is charged for.
Must never: write anything, import torch, or crash on a host that differs from ours. A missing
file, a permission error or a process that exits mid-scan gives "unknown" (`None`), never an
exception.

cgroup v1 (`memory.usage_in_bytes`, `memory.max_usage_in_bytes`, `memory.stat` hierarchical
`total_*` counters, `memory.kmem.usage_in_bytes`) and v2 (`memory.current`, `memory.peak`,
`memory.stat`) are normalised to one set of kinds: usage, peak, anon, file, shmem, file_mapped,
kernel, unevictable. v1 `rss` counts anonymous memory (and swap cache), `cache` counts page-cache
and shmem pages, as the kernel's cgroup-v1 memory documentation defines them.

What the cgroup cannot see: on CUDA, memory registered with `cudaHostRegister` shows neither in
`VmPin` nor `VmLck`, so only the engine knows it (`dlo_host_pinned_bytes`); on Ascend, the NPU
driver's DMA memory behind `pin_memory()` is charged to no cgroup at all. `cgroup_invisible_bytes`
estimates the latter as node used memory (`MemTotal - MemFree`) minus what the cgroup hierarchy
accounts for (v1: the root's `memory.usage_in_bytes`; v2: the sum of the top-level cgroups'
`memory.current`, the root having none). Kernel memory outside every cgroup counts too: it is an
estimate, labelled as one.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_KINDS = ("usage", "peak", "anon", "file", "shmem", "file_mapped", "kernel", "unevictable")

# memory.stat keys per kind; v1 reads the hierarchical `total_*` counters (a pod's cgroup holds
# its containers' cgroups below it).
_V1_STAT = {
    "anon": "total_rss",
    "file": "total_cache",
    "shmem": "total_shmem",
    "file_mapped": "total_mapped_file",
    "unevictable": "total_unevictable",
}
_V2_STAT = {k: k for k in ("anon", "file", "shmem", "file_mapped", "kernel", "unevictable")}
# v2 kernels before 5.18 have no `kernel` line: the sum of its parts.
_V2_KERNEL_PARTS = ("kernel_stack", "pagetables", "percpu", "sock", "slab", "vmalloc")

# A pod's cgroup component: cgroupfs `pod<uid>` or systemd `kubepods-<qos>-pod<uid_>.slice`
# (systemd escapes the UID's dashes as underscores).
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD_COMPONENT = re.compile(rf"^(?:kubepods(?:-[a-z]+)*-)?pod(?P<uid>{_UID})(?:\.slice)?$")


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        return None
    except OSError as e:  # permission denied, ESRCH on an exiting process, ...
        log.debug("unreadable path=%s error=%s", path, e)
        return None


def _exists(path: Path, *, directory: bool = False) -> bool:
    """`Path.exists`/`is_dir` that answer False (unknown) instead of raising on EACCES and the like."""
    try:
        return path.is_dir() if directory else path.exists()
    except OSError as e:
        log.debug("unreadable path=%s error=%s", path, e)
        return False


def _read_int(path: Path) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        log.debug("not an integer path=%s value=%r", path, text[:40])
        return None


def parse_flat_keyed(text: str) -> dict[str, int]:
    """`key value` lines (memory.stat) -> dict; lines that do not parse are skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out[parts[0]] = int(parts[1])
            except ValueError:
                continue
    return out


def parse_kb_table(text: str) -> dict[str, int]:
    """`Key:   123 kB` lines (meminfo, status, smaps_rollup) -> bytes; others are skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep:
            continue
        parts = rest.split()
        if not parts:
            continue
        try:
            value = int(parts[0])
        except ValueError:
            continue
        out[key.strip()] = value * 1024 if len(parts) > 1 and parts[1] == "kB" else value
    return out


# ---------------------------------------------------------------------------------------------
# cgroups


@dataclass(frozen=True)
class CgroupMemory:
    """One cgroup's memory in bytes; a kind is None when this host does not report it."""

    path: str
    version: int
    values: dict[str, int | None]

    def get(self, kind: str) -> int | None:
        return self.values.get(kind)


class CgroupFS:
    """The memory controller under `cgroup_root`: v1 at `<root>/memory`, v2 at `<root>`."""

    def __init__(self, cgroup_root: Path | str = "/sys/fs/cgroup"):
        self.root = Path(cgroup_root)
        if _exists(self.root / "memory" / "memory.usage_in_bytes"):
            self.version: int | None = 1
            self.memory_root = self.root / "memory"
        elif "memory" in (_read_text(self.root / "cgroup.controllers") or "").split():
            self.version = 2
            self.memory_root = self.root
        else:
            self.version = None
            self.memory_root = self.root

    def read(self, rel: str) -> CgroupMemory | None:
        """Memory of the cgroup at `rel` (a path as /proc/<pid>/cgroup shows it); None if absent."""
        if self.version is None:
            return None
        d = self.memory_root / rel.strip("/")
        if not _exists(d, directory=True):
            return None  # gone, or a directory this reader may not search
        if self.version == 1:
            return self._read_v1(d, rel)
        return self._read_v2(d, rel)

    def _read_v1(self, d: Path, rel: str) -> CgroupMemory:
        stat = parse_flat_keyed(_read_text(d / "memory.stat") or "")
        values: dict[str, int | None] = {
            "usage": _read_int(d / "memory.usage_in_bytes"),
            "peak": _read_int(d / "memory.max_usage_in_bytes"),
            "kernel": _read_int(d / "memory.kmem.usage_in_bytes"),
        }
        for kind, key in _V1_STAT.items():
            values[kind] = stat.get(key)
        return CgroupMemory(rel, 1, values)

    def _read_v2(self, d: Path, rel: str) -> CgroupMemory:
        stat = parse_flat_keyed(_read_text(d / "memory.stat") or "")
        values: dict[str, int | None] = {
            "usage": _read_int(d / "memory.current"),
            "peak": _read_int(d / "memory.peak"),
        }
        for kind, key in _V2_STAT.items():
            values[kind] = stat.get(key)
        if values["kernel"] is None and stat and all(p in stat for p in _V2_KERNEL_PARTS[:3]):
            values["kernel"] = sum(stat.get(p, 0) for p in _V2_KERNEL_PARTS)
        return CgroupMemory(rel, 2, values)

    def charged_bytes(self) -> int | None:
        """Memory the whole hierarchy accounts for (see the module docstring)."""
        if self.version == 1:
            return _read_int(self.memory_root / "memory.usage_in_bytes")
        if self.version == 2:
            total, seen = 0, False
            try:
                children = [p for p in self.memory_root.iterdir() if p.is_dir()]
            except OSError:
                return None
            for child in children:
                current = child / "memory.current"
                try:
                    current.stat()
                except (FileNotFoundError, NotADirectoryError):
                    continue  # no memory controller there
                except OSError:
                    return None
                v = _read_int(current)
                if v is None:
                    return None  # present but unreadable: a partial sum would inflate the estimate
                total, seen = total + v, True
            return total if seen else None
        return None


def memory_cgroup_of(cgroup_file_text: str) -> str | None:
    """The memory-controller path of a `/proc/<pid>/cgroup` text (v1 `memory` line, else v2 `0::`)."""
    unified = None
    for line in cgroup_file_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if "memory" in controllers.split(","):
            return path
        if controllers == "" and parts[0] == "0":
            unified = path
    return unified


@dataclass(frozen=True)
class PodRef:
    uid: str  # with dashes, as the API shows it
    cgroup: str  # path of the pod's cgroup, relative to the memory controller root


def pod_of_cgroup(path: str) -> PodRef | None:
    """The pod a cgroup path belongs to, for the cgroupfs and systemd kubelet layouts.

    `/kubepods/burstable/pod<uid>/<container>` and
    `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/cri-...scope`
    give the pod cgroup up to the pod component. Leading components before `kubepods` (a reader in
    its own cgroup namespace sees `/../..`) are dropped.
    """
    parts = [p for p in path.split("/") if p]
    start = next((i for i, p in enumerate(parts) if p.startswith("kubepods")), None)
    if start is None:
        return None
    for i in range(start, len(parts)):
        m = _POD_COMPONENT.match(parts[i])
        if m:
            uid = m.group("uid").replace("_", "-")
            return PodRef(uid=uid, cgroup="/" + "/".join(parts[start : i + 1]))
    return None


# ---------------------------------------------------------------------------------------------
# processes and the node


@dataclass(frozen=True)
class ProcessMemory:
    pid: int
    cgroup: str | None
    rss: int | None
    pss: int | None
    pss_anon: int | None
    pss_file: int | None
    locked: int | None  # VmLck
    pinned: int | None  # VmPin


@dataclass
class ProcFS:
    proc_root: Path = field(default_factory=lambda: Path("/proc"))

    def __post_init__(self) -> None:
        self.proc_root = Path(self.proc_root)

    def meminfo(self) -> dict[str, int]:
        return parse_kb_table(_read_text(self.proc_root / "meminfo") or "")

    def pids(self) -> list[int]:
        try:
            return sorted(int(p.name) for p in self.proc_root.iterdir() if p.name.isdigit())
        except OSError:
            return []

    def process(self, pid: int) -> ProcessMemory | None:
        """One process's memory; None when it is gone. Unreadable parts are None."""
        d = self.proc_root / str(pid)
        status_text = _read_text(d / "status")
        if status_text is None:
            return None  # exited (or never was)
        status = parse_kb_table(status_text)
        rollup = parse_kb_table(_read_text(d / "smaps_rollup") or "")
        cg_text = _read_text(d / "cgroup")
        return ProcessMemory(
            pid=pid,
            cgroup=memory_cgroup_of(cg_text) if cg_text is not None else None,
            rss=rollup.get("Rss"),
            pss=rollup.get("Pss"),
            pss_anon=rollup.get("Pss_Anon"),
            pss_file=rollup.get("Pss_File"),
            locked=status.get("VmLck"),
            pinned=status.get("VmPin"),
        )

    def processes(self) -> list[ProcessMemory]:
        return [p for pid in self.pids() if (p := self.process(pid)) is not None]


NODE_KINDS = ("total", "available", "page_cache", "mlocked")


def node_memory(meminfo: dict[str, int]) -> dict[str, int | None]:
    """`dlo_node_memory_bytes` kinds from a parsed /proc/meminfo."""
    return {
        "total": meminfo.get("MemTotal"),
        "available": meminfo.get("MemAvailable"),
        "page_cache": meminfo.get("Cached"),
        "mlocked": meminfo.get("Mlocked"),
    }


def node_used_bytes(meminfo: dict[str, int]) -> int | None:
    total, free = meminfo.get("MemTotal"), meminfo.get("MemFree")
    return None if total is None or free is None else total - free


@dataclass(frozen=True)
class PodMemory:
    uid: str
    cgroup: CgroupMemory | None
    pss: int | None  # sum over its processes; None when no process could be read
    processes: int


@dataclass(frozen=True)
class MemorySnapshot:
    node: dict[str, int | None]
    pods: dict[str, PodMemory]  # by pod UID
    cgroup_invisible_bytes: int | None


def snapshot(proc: ProcFS, cgroups: CgroupFS) -> MemorySnapshot:
    """One scan: node meminfo, every pod's cgroup and PSS, the cgroup-invisible estimate."""
    meminfo = proc.meminfo()
    pod_cgroups: dict[str, str] = {}
    pss: dict[str, int] = {}
    counts: dict[str, int] = {}
    for p in proc.processes():
        ref = pod_of_cgroup(p.cgroup) if p.cgroup else None
        if ref is None:
            continue
        pod_cgroups[ref.uid] = ref.cgroup
        counts[ref.uid] = counts.get(ref.uid, 0) + 1
        if p.pss is not None:
            pss[ref.uid] = pss.get(ref.uid, 0) + p.pss
    pods = {
        uid: PodMemory(uid, cgroups.read(cg), pss.get(uid), counts[uid]) for uid, cg in pod_cgroups.items()
    }
    used, charged = node_used_bytes(meminfo), cgroups.charged_bytes()
    invisible = None if used is None or charged is None else max(0, used - charged)
    return MemorySnapshot(node_memory(meminfo), pods, invisible)

