"""Fault isolation, drain and connection-flood figures of `dlo serve` (issue 16), as markdown.

Runs the reliability tests that measure them (real `dlo serve` processes, tiny Wan pipeline, CPU,
gloo), collects the `figures: {...}` lines they record (tests/reliability/figures.py) and writes
the tables to OUT (default bench/results/reliability-<today>.md) with the raw JSON lines beside it.

    .venv/bin/python -m bench reliability [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench.lib.provenance import provenance

ROOT = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/reliability/test_request_faults.py",
    "tests/reliability/test_drain.py",
    "tests/reliability/test_connections.py",
    "tests/reliability/test_rank_faults.py",
]


def run(figures: Path) -> tuple[int, float]:
    env = {**os.environ, "DLO_RELIABILITY_FIGURES": str(figures)}
    t0 = time.monotonic()
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], cwd=ROOT, env=env)
    return rc, time.monotonic() - t0


def render(rows: list[dict], rc: int, seconds: float, command: str) -> str:
    by: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        by[r["kind"]].append(r)
    out = [f"# Reliability figures (issue 16), {datetime.date.today().isoformat()}", "",
           f"Measured on {os.cpu_count()} CPU cores ({platform.machine()}, Python {platform.python_version()}, "
           "torch CPU build, gloo), against real `dlo serve` processes over real HTTP: the tiny random Wan pipeline "
           "(`dlo make-tiny-model`). Timings on a shared machine move by tens of percent between runs; the "
           "assertions in the tests carry the margins.", "",
           f"Produced by `{command}` (pytest exit code {rc}, {seconds:.0f} s); the raw figures are the JSON "
           "lines next to this file.", ""]

    faults = by["request_fault"]
    if faults:
        out += ["## Faults injected per phase and mode (tests/reliability/test_request_faults.py)", "",
                "Test-only hook `DLO_TEST_HOOKS=1 DLO_TEST_FAULTS=phase:rank:prompt-match`; one server per (mode, "
                "dp) with every phase armed at once. dp 2: the faulty request shares its wave with a good one "
                "(on rank 0 or rank 1 in turn); dp 1: the next request follows it. *Lost* counts requests other "
                "than the faulty one that did not get their 200 with the bytes of the same request run alone.", ""]
        phases = list(dict.fromkeys(r["phase"] for r in faults if r["phase"] != "forward"))
        configs = list(dict.fromkeys((r["mode"], r["dp"]) for r in faults if r["phase"] != "forward"))
        out += ["| mode | dp | " + " | ".join(phases) + " | lost |", "|---|---|" + "---|" * (len(phases) + 1)]
        for mode, dp in configs:
            cells = []
            lost = 0
            for ph in phases:
                r = next((x for x in faults if (x["mode"], x["dp"], x["phase"]) == (mode, dp, ph)), None)
                cells.append("-" if r is None else str(r["faulty_status"]))
                lost += r["requests_lost"] if r else 0
            out.append(f"| {mode} | {dp} | " + " | ".join(cells) + f" | {lost} |")
        fwd = [r for r in faults if r["phase"] == "forward"]
        out += ["", "Cells: what the faulty request got (500: OpenAI error JSON `generation_failed` naming the "
                "phase; `failed job`: the video job's status with that error). The engine served on after "
                "every one of them (`/health` and `/ready` 200, same bytes afterwards)."]
        for r in fwd:
            out += ["", f"Inside a transformer forward (`forward`, {r['mode']} dp {r['dp']}): the gather order is "
                    f"lost, so the wave fails as for a dead rank: both requests of the wave got "
                    f"{r['faulty_status']} `engine_failed` (lost outside the faulty request: {r['requests_lost']}) "
                    "and the server exited non-zero for the pod to restart. By design."]
        out.append("")

    drains = by["drain"]
    if drains:
        out += ["## Drain on SIGTERM (tests/reliability/test_drain.py)", "",
                "A full wave of 128x128 requests running (seen on `/health`) when SIGTERM arrives; in the "
                "`exceeds` case one more request waits in the queue.", "",
                "| mode | dp | case | grace | steps | in flight + queued | 200 | 503 JSON | /ready 503 after | exit code | "
                "exit after SIGTERM |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in drains:
            out.append(f"| {r['mode']} | {r['dp']} | {r['case']} | {r['grace_s']:g} s | {r['steps']} | "
                       f"{r['in_flight']} + {r['queued']} | {r['answered_200']} | {r['answered_503']} | "
                       f"{r['ready_503_after_s']} s | {r['exit_code']} | {r['exit_seconds']} s |")
        out += ["", "Every 503 is OpenAI's JSON (`shutting_down`, Retry-After), never uvicorn's plain-text 500; "
                "a request arriving during the drain gets the same 503 at once; no process of the tree is left.",
                ""]

    floods = by["connection_flood"]
    if floods:
        out += ["## Connection floods (tests/reliability/test_connections.py)", "",
                "`dlo serve --dp 1 --mode resident` started with RLIMIT_NOFILE 512 in its own process. Before "
                "this change (measured once by hand on this machine: RLIMIT_NOFILE 300, 350 idle connections "
                "held 7 s) asyncio logged `socket.accept() out of system resource` with a traceback for every "
                "failed accept: 20,377 events, 122,302 log lines.", "",
                "| case | connections | log lines during the flood | outcome | serves again after |",
                "|---|---|---|---|---|"]
        for r in floods:
            if r["case"] == "cap":
                outcome = (f"cap {r['max_connections']}: {r['refused_503']} refused with 503 JSON at once, "
                           f"{r['idle_closed']} silent ones closed {r['seconds_to_idle_close']} s after "
                           f"(--idle-timeout {r['idle_timeout_s']:g})")
            else:
                outcome = "descriptors exhausted (cap set above the limit): one line at the start, one at the end"
            out.append(f"| {r['case']} | {r['connections']} | {r['log_lines']} | {outcome} | "
                       f"{r['seconds_to_serve_again']} s |")
        out.append("")

    ranks = by["rank_fault"]
    if ranks:
        out += ["## Rank faults mid-wave, for comparison (tests/reliability/test_rank_faults.py)", "",
                "| fault | in flight | 503 | connection closed | last answer after | exit after |",
                "|---|---|---|---|---|---|"]
        for r in ranks:
            out.append(f"| {r['fault']} | {r['requests_in_flight']} | {r['answered_503']} | {r['connection_closed']} | "
                       f"{r['seconds_to_last_answer']} s | {r['seconds_to_server_exit']} s |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench reliability", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path,
                    default=ROOT / "bench" / "results" / f"reliability-{datetime.date.today().isoformat()}.md")
    ap.add_argument("--render", type=Path, default=None,
                    help="only render OUT from these figures (JSON lines of an earlier run)")
    args = ap.parse_args(argv)
    if args.render is not None:
        lines = args.render.read_text()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            figures = Path(tmp) / "figures.jsonl"
            figures.touch()
            rc, seconds = run(figures)
            lines = json.dumps({"kind": "run", "rc": rc, "seconds": round(seconds), "provenance": provenance("cpu")}) \
                + "\n" + figures.read_text()
    rows = [json.loads(line) for line in lines.splitlines() if line.strip()]
    meta = next((r for r in rows if r["kind"] == "run"), {"rc": "unknown", "seconds": 0})
    args.out.write_text(render(rows, meta["rc"], meta["seconds"], "python -m bench reliability"))
    if args.render is None:
        args.out.with_suffix(".jsonl").write_text(lines)
    print(f"wrote {args.out} ({len(rows)} figures)")
    return 0 if meta["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
