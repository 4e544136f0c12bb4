"""The hardening attacks (issue 32) against real `dlo agent` and `dlo serve` processes on loopback,
as figures: connections held, seconds of /health outage, threads, requests run after their client
left, and what each edge case got back.

Runs with whichever `dlo` the interpreter imports, so the same script measures a checkout before
and after a change (run it with that checkout's `.venv/bin/python`):

    /path/to/before/.venv/bin/python bench/reliability_attacks.py --json /tmp/before.json
    .venv/bin/python bench/reliability_attacks.py --json /tmp/after.json
    .venv/bin/python bench/reliability_attacks.py --render /tmp/before.json /tmp/after.json \\
        --out bench/results/reliability-2026-12-01.md

Groups: `agent` (item 1, 2 and the agent's smaller items), `serve` (items 3-7), `edges` (items 8
and 9); `--only GROUP` runs one. Needs root for the read-only folder (a tmpfs remounted read-only).
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

GROUPS = ("agent", "serve", "edges")


def measure(only: str | None) -> dict:
    from reliability_probe import tiny_models

    import dlo.engine

    out: dict = {"tree": str(Path(dlo.engine.__file__).resolve().parent.parent), "python": platform.python_version(),
                 "cpus": os.cpu_count(), "date": datetime.date.today().isoformat()}
    root = Path(tempfile.mkdtemp(prefix="dlo-attacks-"))
    try:
        models = tiny_models(root)
        for group in GROUPS:
            if only not in (None, group):
                continue
            t0 = time.monotonic()
            if group == "agent":
                from reliability_attacks_agent import run as run_agent

                out[group] = run_agent(root, models["wan"])
            elif group == "serve":
                from reliability_attacks_serve import run as run_serve

                out[group] = run_serve(root, models)
            else:
                from reliability_attacks_edges import run as run_edges

                out[group] = run_edges(root, models)
            out[f"{group}_seconds"] = round(time.monotonic() - t0)
    finally:
        subprocess.run(["rm", "-rf", str(root)])  # the deep tree is beyond shutil.rmtree's recursion
    return out


def _cell(v: object) -> str:
    return "-" if v is None else json.dumps(v, ensure_ascii=False).replace("|", "\\|")


def _flatten(d: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(d, dict) or not d:
        return {prefix: d}
    out: dict[str, object] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v and all(not isinstance(x, dict) for x in v.values()) and len(v) > 6:
            out[key] = v
        elif isinstance(v, dict) and v:
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def render(before: dict, after: dict) -> str:
    lines = [f"# Hardening attacks (issue 32), {after.get('date')}", "",
             f"Measured on {after.get('cpus')} CPU cores (Python {after.get('python')}, torch CPU build), real "
             "`dlo agent` and `dlo serve` processes on loopback, the tiny random Wan pipelines. *Before*: the tree "
             f"at `{before.get('tree')}` (main before this change); *after*: `{after.get('tree')}`. The same "
             "script measured both: `python bench/reliability_attacks.py --json FILE` with each tree's "
             "interpreter, rendered with `--render BEFORE AFTER`. Timings on a shared 2-core machine move by tens "
             "of percent; the raw JSON is beside this file.", ""]
    for group in GROUPS:
        if group not in before and group not in after:
            continue
        lines += [f"## {group} ({before.get(group + '_seconds', '-')} s before, {after.get(group + '_seconds', '-')} "
                  "s after)", "", "| attack | figure | before | after |", "|---|---|---|---|"]
        b, a = before.get(group, {}), after.get(group, {})
        for attack in dict.fromkeys([*b, *a]):
            fb, fa = _flatten(b.get(attack)), _flatten(a.get(attack))
            for fig in dict.fromkeys([*fb, *fa]):
                lines.append(f"| {attack} | {fig or '-'} | {_cell(fb.get(fig))} | {_cell(fa.get(fig))} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="measure, and write the figures here")
    ap.add_argument("--only", choices=GROUPS, help="measure one group")
    ap.add_argument("--render", type=Path, nargs=2, metavar=("BEFORE", "AFTER"), help="render two measurements")
    ap.add_argument("--out", type=Path, help="the markdown file --render writes (default: stdout)")
    args = ap.parse_args()
    if args.render:
        text = render(json.loads(args.render[0].read_text()), json.loads(args.render[1].read_text()))
        if args.out:
            args.out.write_text(text + "\n")
            print(f"wrote {args.out}")
        else:
            print(text)
        return 0
    if args.json is None:
        ap.error("--json FILE (measure) or --render BEFORE AFTER")
    figures = measure(args.only)
    if args.json.exists() and args.only:  # one group again: keep the others
        figures = {**json.loads(args.json.read_text()), **figures}
    args.json.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    print(json.dumps(figures, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
