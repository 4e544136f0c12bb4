"""The hardening attacks (issue 32) against real `dlo agent` and `dlo serve` processes on loopback,
as figures: connections held, seconds of /health outage, threads, requests run after their client
left, and what each edge case got back.

Runs with whichever `dlo` the interpreter imports, so the same script measures a checkout before
and after a change (run it with that checkout's `.venv/bin/python`):

    /path/to/before/.venv/bin/python -m bench attacks --json /tmp/before.json
    .venv/bin/python -m bench attacks --json /tmp/after.json
    .venv/bin/python -m bench attacks --render /tmp/before.json /tmp/after.json \\
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

from bench.lib.provenance import provenance


GROUPS = ("agent", "serve", "edges")


def measure(only: str | None) -> dict:
    from bench.reliability_probe import tiny_models

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
                from bench.reliability_attacks_agent import run as run_agent

                out[group] = run_agent(root, models["wan"])
            elif group == "serve":
                from bench.reliability_attacks_serve import run as run_serve

                out[group] = run_serve(root, models)
            else:
                from bench.reliability_attacks_edges import run as run_edges

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


# (finding, figure, path into the measurement): the headline figures, one row each
SUMMARY = [
    ("1 agent: one bad folder", "good folders in /profile (of 2)", "agent.agent_bad_folder.profile_models"),
    ("1 agent: one bad folder", "folders flagged broken", "agent.agent_bad_folder.flagged_broken"),
    ("2 agent: 1,000 half-sent heads", "connections held after 20 s", "agent.agent_half_sent_1000.held_after_window"),
    ("2 agent: 1,000 half-sent heads", "threads during the flood", "agent.agent_half_sent_1000.threads_during"),
    ("2 agent: 1,000 half-sent heads", "seconds of /health outage, probed from another address",
     "agent.agent_half_sent_1000.other_address.outage_s"),
    ("2 agent: 1,000 half-sent heads", "seconds of /health outage, probed from the flood's address",
     "agent.agent_half_sent_1000.same_address.outage_s"),
    ("3 serve: 4 slow bodies, --max-connections 4", "connections held after 25 s", "serve.serve_slow_bodies.held_after_window"),
    ("3 serve: 4 slow bodies, --max-connections 4", "seconds of /health outage (of 25)", "serve.serve_slow_bodies.outage_s"),
    ("4 serve: 30 clients leave after 50 ms", "requests run on the ranks", "serve.serve_disconnects.ran_on_ranks"),
    ("4 serve: 30 clients leave after 50 ms", "dlo_requests_total by code", "serve.serve_disconnects.counted"),
    ("5 serve: 20 x 4096x4096 PNG references", "seconds of /health outage", "serve.serve_reference_images.outage_s"),
    ("5 serve: 20 x 4096x4096 PNG references", "answers (small profile)", "serve.serve_reference_images.answers"),
    ("5 serve: the same, decoded (pixel cap 4096x4096)", "seconds of /health outage",
     "serve.serve_reference_images_decoded.outage_s"),
    ("5 serve: the same, decoded (pixel cap 4096x4096)", "answers", "serve.serve_reference_images_decoded.answers"),
    ("6 serve: read-only video folder", "DELETE answer", "serve.serve_read_only_videos.delete"),
    ("6 serve: read-only video folder", "files left after the DELETE", "serve.serve_read_only_videos.files_left"),
    ("6 serve: read-only video folder", "GET of the job after a restart", "serve.serve_read_only_videos.after_restart"),
    ("6 serve: read-only video folder", "warned at start", "serve.serve_read_only_videos.warned_at_start"),
    ("6 serve: read-only video folder", "create on it", "serve.serve_read_only_videos.create_on_read_only"),
    ("7 serve: silent peer on the control socket", "ready", "serve.serve_silent_control_peer.ready"),
    ("7 serve: silent peer on the control socket", "seconds to ready (or to give up)", "serve.serve_silent_control_peer.seconds_to_ready_or_exit"),
    ("7 serve: silent peer on the control socket", "/health after", "serve.serve_silent_control_peer.health_after"),
    ("8 HTTP: a 100 KiB head", "status, content type", "edges.framing.head_100KiB"),
    ("8 HTTP: a 200 KiB head", "status, content type", "edges.framing.head_200KiB"),
    ("8 HTTP: Content-Length + Transfer-Encoding", "responses on the connection", "edges.framing.cl_and_te.responses"),
    ("8 HTTP: HEAD /health", "status", "edges.framing.head_health"),
    ("9 a 5,000-digit integer", "status, code", "edges.bodies.int_5000_digits"),
    ("9 size \"64x64\\n\"", "status, code", "edges.bodies.size_newline"),
    ("9 multipart without its closing boundary", "status, code", "edges.bodies.multipart_unclosed"),
    ("9 two Authorization headers", "status", "edges.headers.two_authorization_headers"),
    ("9 /docs without the key", "status", "edges.headers.no_key_docs"),
    ("9 --api-key-file not UTF-8", "exit code, traceback", "edges.key_files.key_file_not_utf8"),
    ("9 a non-ASCII key", "started", "edges.key_files.non_ascii_key.started"),
    ("9 the port in use", "exit code, seconds", "edges.port_in_use"),
    ("9 the video job cap", "another client's finished job kept", "edges.job_cap.victim_job_kept"),
    ("9 agent: a newline in a folder name", "log line split", "agent.agent_newline_name.line_split"),
    ("9 dlo warm: a 0-byte file", "exit code, last line", "agent.warm_and_plan.warm_zero_byte"),
    ("9 dlo plan --dp 23 digits", "exit code", "agent.warm_and_plan.plan_huge_dp.rc"),
]


def _at(d: dict, path: str) -> object:
    for key in path.split("."):
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    if isinstance(d, dict) and {"rc", "traceback"} <= set(d):
        return [d["rc"], d.get("seconds_to_exit", "traceback" if d["traceback"] else d.get("last_line", "")[:80])]
    return d


NOTES = [
    "How to read it:",
    "- 2: the agent's server caps connections per client address (32) and closes a head not complete "
    "within 5 s; probed from the flood's own address, /health is refused until those 5 s free a place "
    "(by design: one address cannot take another's place); from another address (the kubelet's) it never "
    "waits. Before, every connection held a thread (905 threads) for as long as the client liked.",
    "- 3: the four slow clients are answered 408 within the body timeout (10 s, plus 1 s per 4096 bytes); "
    "/health from loopback is a probe address and is served from the reserve even while they hold the cap.",
    "- 4: one request was running when its client left: its wave finished (the collective schedule is never "
    "cut) and it is counted 499 with the 29 that were dropped from the queue.",
    "- 5: the small profile caps references at 512 x 512, so after the change the 4096 x 4096 images are "
    "refused from their header; the 'decoded' row raises the cap to 4096 x 4096 (the default profile's), so "
    "every image is decoded, off the event loop. The field does not exist before the change ('-').",
    "- 6: before, DELETE answered deleted: true and left both files (the job came back after a restart); "
    "after, it answers storage_error and the job stays as it is, consistently.",
    "- 7: the silent peer is accepted beside the children and dropped after its 10 s handshake deadline; "
    "the seconds are the whole start of a dp 2 server on the loaded machine.",
    "",
]


def _summary(before: dict, after: dict) -> list[str]:
    out = ["## Summary", "", "| finding | figure | before | after |", "|---|---|---|---|"]
    out += [f"| {name} | {fig} | {_cell(_at(before, path))} | {_cell(_at(after, path))} |" for name, fig, path in SUMMARY]
    return out + ["", *NOTES]


def render(before: dict, after: dict) -> str:
    lines = [f"# Hardening attacks (issue 32), {after.get('date')}", "",
             f"Measured on {after.get('cpus')} CPU cores (Python {after.get('python')}, torch CPU build), real "
             "`dlo agent` and `dlo serve` processes on loopback, the tiny random Wan pipelines. *Before*: the tree "
             f"at `{before.get('tree')}` (main before this change); *after*: `{after.get('tree')}`. The same "
             "script measured both: `python -m bench attacks --json FILE` with each tree's "
             "interpreter, rendered with `--render BEFORE AFTER`. Timings on a shared 2-core machine move by tens "
             "of percent; the raw JSON is beside this file.", "", *_summary(before, after), "## Every figure", ""]
    for group in GROUPS:
        if group not in before and group not in after:
            continue
        lines += [f"### {group} ({before.get(group + '_seconds', '-')} s before, {after.get(group + '_seconds', '-')} "
                  "s after)", "", "| attack | figure | before | after |", "|---|---|---|---|"]
        b, a = before.get(group, {}), after.get(group, {})
        for attack in dict.fromkeys([*b, *a]):
            fb, fa = _flatten(b.get(attack)), _flatten(a.get(attack))
            for fig in dict.fromkeys([*fb, *fa]):
                lines.append(f"| {attack} | {fig or '-'} | {_cell(fb.get(fig))} | {_cell(fa.get(fig))} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench attacks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="measure, and write the figures here")
    ap.add_argument("--only", choices=GROUPS, help="measure one group")
    ap.add_argument("--render", type=Path, nargs=2, metavar=("BEFORE", "AFTER"), help="render two measurements")
    ap.add_argument("--out", type=Path, help="the markdown file --render writes (default: stdout)")
    args = ap.parse_args(argv)
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
    figures["provenance"] = provenance("cpu")
    args.json.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    print(json.dumps(figures, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
