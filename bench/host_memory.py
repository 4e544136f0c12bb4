"""Host memory of a process (tree), as the kernel accounts it: what the pipeline benchmark records.

Owns: `tree_memory` (sums of each process's `/proc/PID/smaps_rollup`: PSS in total and anonymous,
file-backed and shmem apart, private bytes, RSS, locked; plus the PSS of `*.safetensors` mappings
from the per-mapping `/proc/PID/smaps`, the page cache the ranks read weights from, and the peak RSS
of the processes read). PSS counts a page shared by N processes 1/N in each, so a tree's sum counts
the page cache the ranks map once.
Must never: read per-mapping smaps for anything but the safetensors share (it has no `Pss_Anon`
line: every pipeline record before this module said 0 for it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROLLUP = {"Pss": "pss_bytes", "Pss_Anon": "pss_anon_bytes", "Pss_File": "pss_file_bytes",
          "Pss_Shmem": "pss_shmem_bytes", "Rss": "rss_bytes", "Locked": "locked_bytes"}


def tree_memory(pid: int, *, children: bool = True) -> dict[str, Any]:
    """Host memory of `pid` and (by default) its descendants."""
    import psutil

    from dlo.agent.memory import parse_kb_table

    root = psutil.Process(pid)
    out: dict[str, Any] = {v: 0 for v in ROLLUP.values()}
    out.update(private_bytes=0, pss_safetensors_bytes=0, rss_peak_bytes=0, source="smaps_rollup")
    for p in [root, *(root.children(recursive=True) if children else [])]:
        try:
            rollup = parse_kb_table(Path(f"/proc/{p.pid}/smaps_rollup").read_text())
        except OSError:  # exited meanwhile
            continue
        for k, v in ROLLUP.items():
            out[v] += rollup.get(k, 0)
        out["private_bytes"] += rollup.get("Private_Clean", 0) + rollup.get("Private_Dirty", 0)
        out["pss_safetensors_bytes"] += _safetensors_pss(p.pid)
        out["rss_peak_bytes"] += _vm_hwm(p.pid)
    return out


def _safetensors_pss(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return 0
    total, path = 0, ""
    for line in text.splitlines():
        head = line.split()
        if not head:
            continue
        if not head[0].endswith(":") or "-" in head[0]:  # a mapping's first line: range perms ... [path]
            path = head[5] if len(head) > 5 else ""
        elif head[0] == "Pss:" and path.endswith(".safetensors"):
            total += int(head[1]) * 1024
    return total


def _vm_hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
