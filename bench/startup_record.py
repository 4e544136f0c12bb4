"""The record of `bench/startup.py`: what rank 0's log says about a cold start's reads, the summary of
the starts, its markdown and the merge of several calls.

Owns: `log_facts` (registration and readahead figures from rank 0's log), `summarize` (every mode's
ready seconds with their spread, the first start apart; cold starts against the disk read),
`markdown` and `merge` (raw records of one card into `<stem>.{json,md}`).
Must never: measure (the starts are `bench/startup.py`'s).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from typing import Any

from bench.lib import merge as merging
from bench.lib import records

GOAL_READY_S = 10.0
GOAL_COLD_RATIO = 1.0

_REGISTERED = re.compile(r"^rank0 .*?early registration of (\S+): .*?, ([\d.]+) s \(([\d.]+) s of it waiting"
                         r"( for the readahead to read the weights|"
                         r" for the start's other files, ([\d.]+) s for the readahead to read the weights)?", re.M)
_READAHEAD_DONE = re.compile(r"^rank0 .*?readahead done seconds=([\d.]+) result=(\{.*\}) \(beside the imports\)", re.M)
_ADOPTED = re.compile(r"^rank0 .*?readahead of .* adopted \(started with dlo serve's checks, ([\d.]+) s before this load\)",
                      re.M)


def log_facts(text: str) -> dict[str, Any]:
    """What rank 0's log says about a cold start's reads: each early registration's seconds and
    the parts of them it waited for the readahead's first files and then for its read of each
    weights file (`registration`; the latter where the log says it), the readahead's
    own result with its first phase (`readahead`; `job_seconds`: its job's own run time), and
    how long before the load it started (`readahead_lead_seconds`); only what the log has."""
    import ast

    out: dict[str, Any] = {}
    for name, seconds, waited, tail, behind in _REGISTERED.findall(text):
        if tail.startswith(" for the readahead"):  # one wait: the weights' read
            reg = {"seconds": float(seconds), "read_wait_seconds": float(waited)}
        else:
            reg = {"seconds": float(seconds), "waited_seconds": float(waited)}
            if behind:
                reg["read_wait_seconds"] = float(behind)
        out.setdefault("registration", {})[name] = reg
    if m := _READAHEAD_DONE.search(text):
        out["readahead"] = {**ast.literal_eval(m.group(2)), "job_seconds": float(m.group(1))}
    if m := _ADOPTED.search(text):
        out["readahead_lead_seconds"] = float(m.group(1))
    return out


def start_kind(s: dict) -> str:
    """warm, cold (the checkpoint evicted) or cold-node (the whole page cache dropped)."""
    if not s["cold"]:
        return "warm"
    return "cold-node" if (s.get("evicted") or {}).get("drop_caches") else "cold"


def _counted(starts: list[dict], mode: str, kind: str) -> list[dict]:
    """The starts of `mode` that the figures count: of `kind` (`start_kind`), not profiled, ready."""
    return [s for s in starts
            if s["mode"] == mode and start_kind(s) == kind and not s.get("profiled") and "ready_seconds" in s]


def _ready(starts: list[dict], mode: str, kind: str) -> list[float]:
    return [s["ready_seconds"] for s in _counted(starts, mode, kind)]


def summarize(raws: list[dict]) -> dict[str, Any]:
    """The record's summary over every start of `raws` (medians and maxima per mode)."""
    starts = [s for raw in raws for s in raw["starts"]]
    modes = sorted({s["mode"] for s in starts})
    out: dict[str, Any] = {}
    for key, kind in (("ready_seconds", "warm"), ("cold_ready_seconds", "cold"), ("node_cold_ready_seconds", "cold-node")):
        per = {m: _ready(starts, m, kind) for m in modes}
        out[f"{key}_median"] = {m: round(statistics.median(v), 2) for m, v in per.items() if v}
        out[f"{key}_max"] = {m: round(max(v), 2) for m, v in per.items() if v}
        out[f"{key}_n"] = {m: len(v) for m, v in per.items() if v}
    # the server's own clock: its process age when it turned ready (no poll interval in it)
    own = {m: [st["startup_seconds"]["total"] for st in _counted(starts, m, "warm")
               if (st.get("startup_seconds") or {}).get("total")] for m in modes}
    out["server_ready_seconds_median"] = {m: round(statistics.median(v), 2) for m, v in own.items() if v}
    reads = [raw["disk_read"]["seconds"] for raw in raws if raw.get("disk_read")]
    if reads and statistics.median(reads) > 0:
        out["disk_read_seconds"] = round(statistics.median(reads), 4)
        warm = out["ready_seconds_median"]
        for prefix in ("", "node_"):
            cold = out[f"{prefix}cold_ready_seconds_median"]
            out[f"{prefix}cold_extra_over_disk_read"] = {m: round((cold[m] - warm[m]) / out["disk_read_seconds"], 3)
                                                         for m in cold if m in warm}
    shas = {s["mode"]: s["output_sha256"] for s in starts if s.get("output_sha256")}
    if shas:
        out["same_output_every_mode"] = len(set(shas.values())) == 1
    out["goal_ready_seconds"], out["goal_cold_extra_over_disk_read"] = GOAL_READY_S, GOAL_COLD_RATIO
    out["failed_starts"] = sum(1 for s in starts if "error" in s or s.get("exit_code") not in (0, None))
    out["failed_checks"] = sum(1 for s in starts if "check_error" in s)
    return out


def markdown(rec: dict) -> str:
    s = rec["summary"]
    lines = [f"# Ready on {rec.get('card') or 'one card'}: {rec['preset']} ({rec['date']})", "",
             f"Sources: {', '.join(x if isinstance(x, str) else x['file'] for x in rec['sources'])}. Package set: "
             "optional packages installed "
             f"{rec['optional_packages']}. Goal: ready <= {GOAL_READY_S:.0f} s in every mode, warm-up included; "
             f"cold extra <= {GOAL_COLD_RATIO} x one read of the folder.", "",
             "Cold: the checkpoint evicted; node-cold: the whole page cache dropped (Python libraries too).", "",
             "| mode | warm median | warm max | n | cold median | cold max | n | cold extra / disk read "
             "| node-cold median | node-cold max | n | node-cold extra / disk read |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in sorted(set(s["ready_seconds_median"]) | set(s["cold_ready_seconds_median"])
                    | set(s.get("node_cold_ready_seconds_median", {}))):
        row = [s.get(k, {}).get(m, "") for k in (
            "ready_seconds_median", "ready_seconds_max", "ready_seconds_n", "cold_ready_seconds_median",
            "cold_ready_seconds_max", "cold_ready_seconds_n", "cold_extra_over_disk_read",
            "node_cold_ready_seconds_median", "node_cold_ready_seconds_max", "node_cold_ready_seconds_n",
            "node_cold_extra_over_disk_read")]
        lines.append(f"| {m} | " + " | ".join(map(str, row)) + " |")
    lines += ["", f"Disk read of the folder once: {s.get('disk_read_seconds', 'not measured')} s. "
              f"Same output in every mode: {s.get('same_output_every_mode', 'not checked')}.", "",
              "Phases of each start (rank 0, seconds; `before: {...}` are `dlo serve`'s steps before the load, "
              "`warmup_*` the warm-up request's):", ""]
    for raw in rec["raws"]:
        for st in raw["starts"]:
            phases = (st.get("startup_seconds") or {}).get("phases", {})
            before = (st.get("startup_seconds") or {}).get("before_load_phases")
            phases = {"before": before, **phases} if before else phases
            kind = "profiled" if st.get("profiled") else start_kind(st)
            check = f"; check request first/second {st['check_seconds']} s" if st.get("check_seconds") else ""
            lines.append(f"- {st['mode']} {kind} {st['start']}: ready "
                         f"{st.get('ready_seconds', st.get('error'))} s; {json.dumps(phases)}{check}{_reads_text(st)}")
    lines += _profile_lines(rec)
    lines += ["", "Commands:", ""] + [f"- `{raw['command']}`" for raw in rec["raws"]]
    return "\n".join(lines) + "\n"


def _reads_text(st: dict) -> str:
    """A cold start's reads from its log (`log_facts`), as a clause of its line ("" for none)."""
    parts = []
    if "readahead_lead_seconds" in st:
        parts.append(f"readahead started {st['readahead_lead_seconds']} s before the load")
    if first := (st.get("readahead") or {}).get("first"):
        parts.append(f"first files {first['files']} ({first['bytes'] / 1e9:.2f} GB) in {first['seconds']} s")
    for name, reg in (st.get("registration") or {}).items():
        behind = f", {reg['read_wait_seconds']} s for the weights' read" if "read_wait_seconds" in reg else ""
        first = f", {reg['waited_seconds']} s of it waiting" if "waited_seconds" in reg else ""
        parts.append(f"{name} registered in {reg['seconds']} s{first}{behind}")
    return "; " + "; ".join(parts) if parts else ""


def _profile_lines(rec: dict, top: int = 15) -> list[str]:
    """Each profiled start's heaviest frames (py-spy, seconds of samples; not in the figures above)."""
    lines: list[str] = []
    for raw in rec["raws"]:
        for st in (s for s in raw["starts"] if s.get("profiled")):
            prof = st.get("profile") or {}
            lines += ["", f"Profile of {st['mode']} start {st['start']} (py-spy, {prof.get('raw', 'no raw')}): "
                      f"{prof.get('error') or 'seconds per thread ' + json.dumps(prof.get('threads_seconds'))}"]
            for key in ("dlo_inclusive", "module_imports", "inclusive", "self"):
                if prof.get(key):
                    lines.append(f"- {key}: " + "; ".join(f"{n} {t}" for n, t in prof[key][:top]))
    return lines


def merge(args: argparse.Namespace) -> int:
    sources = merging.load(args.files)
    raws = [x.record for x in sources]
    rec = merging.merged("startup", sources, {
        "date": raws[0]["date"], "preset": raws[0]["preset"], "optional_packages": raws[0]["optional_packages"],
        "raws": raws, "summary": summarize(raws)})
    records.write(rec, args.out / f"{args.stem}.json", markdown(rec))
    print(json.dumps(rec["summary"], indent=1))
    return 0


