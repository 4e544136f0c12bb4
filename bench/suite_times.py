"""How long the test suite takes: `make test` (every test) and `make test-quick` (the unit tests, for
local work), as a record the README's figures come from.

    python -m bench tests [--run quick|full|both|none] --out bench/results   # -> tests-cpu-<date>.{json,md}

Owns: `collect` (the tests pytest collects, all and quick), `run` (one pytest run of a set, its wall
seconds, its outcome line and this host's load before it) and the record. A set not run here keeps
the wall times reported elsewhere with where they come from (`REPORTED`), never as a measurement.
Must never: change what CI runs (CI runs every test, `make test`).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.lib import records

QUICK = ["-m", "not slow"]  # `make test-quick`: the marker every multi-process, serving and e2e test carries
REPORTED = [  # the full suite's wall times measured before this record, by others, on 2-core hosts
    {"minutes": 23, "tests": 991, "where": "the CI host (2 cores), a fresh clone, before 2026-12-06"},
    {"minutes": 39, "tests": None, "where": "a newcomer's run on a loaded 2-core machine (issue 58)"},
]


def _pytest(*args: str, timeout: float) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return time.perf_counter() - t0, (lines[-1] if lines else proc.stderr[-300:])


def collect(*args: str) -> int:
    _, last = _pytest("--collect-only", *args, timeout=600)
    m = re.search(r"(\d+)(?:/(\d+))? tests? collected", last)
    return int(m.group(1)) if m else -1


def run(args: list[str]) -> dict[str, Any]:
    load = os.getloadavg()[0]
    seconds, outcome = _pytest(*args, timeout=7200)
    return {"wall_seconds": round(seconds, 1), "outcome": outcome, "load_average_before": round(load, 2),
            "cpus": os.cpu_count()}


def markdown(rec: dict[str, Any]) -> str:
    lines = [f"# The test suite's wall time ({rec['provenance']['date'][:10]})", "",
             f"Command: `{rec['provenance']['command']}`; {rec['provenance']['card']['name']}.", "",
             f"- every test (`make test`): {rec['collected']['all']} collected",
             f"- the quick subset (`make test-quick`, `pytest {' '.join(QUICK)}`): {rec['collected']['quick']}"]
    for name, r in rec["runs"].items():
        lines.append(f"- {name}: {r['wall_seconds'] / 60:.1f} minutes on {r['cpus']} CPUs (load {r['load_average_before']} "
                     f"before), {r['outcome']}")
    lines += [f"- reported before: {r['minutes']} minutes, {r['where']}" for r in rec["full_reported"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench tests", description=__doc__.splitlines()[0])
    ap.add_argument("--run", choices=("quick", "full", "both", "none"), default="quick",
                    help="which set to run and time (both: every test, then the quick subset)")
    ap.add_argument("--out", type=Path, default=Path("bench/results"), help="folder of the record")
    args = ap.parse_args(argv)
    body: dict[str, Any] = {"collected": {"all": collect(), "quick": collect(*QUICK)}, "quick_args": QUICK,
                            "runs": {}, "full_reported": REPORTED}
    for name in {"both": ("full", "quick"), "none": ()}.get(args.run, (args.run,)):
        body["runs"][name] = run(QUICK if name == "quick" else [])
    rec = records.raw("tests", "cpu", body)
    records.write(rec, args.out / f"tests-cpu-{rec['provenance']['date'][:10]}.json", markdown(rec))
    print(markdown(rec))
    return 0
