"""Start-up on one card (issue 34): seconds from process start to `/ready` 200, warm-up included, for
the full Wan2.1-T2V-14B pipeline, per mode, with a warm and with a cold page cache.

    # one H200, one call (the plan's default: warm starts x5 of resident and rank-local, the
    # folder's disk read and two cold resident starts, then the old resident path x2 for the
    # before/after); a start that would end past --time-budget is skipped and counted
    bash bench/device.sh python -m bench startup run --models /tmp/models --raw $OUT/raw-startup.json --check-output \
        --time-budget 330
    python -m bench startup merge RAW... --out bench/results --stem startup-DATE
    python -m bench startup run --dry-run --raw /tmp/raw-ready.json   # CPU, tiny preset: every step

`run` makes the pipeline if it is missing (`dlo make-random-model --preset wan2.1-t2v-14b`, as
`bench/pipeline.py` does: 49-64 s on an H200 host), reads it once into the page cache, then
runs `--plan` in order: `MODE[:N]` is N warm starts of `dlo serve` in MODE (`MODES`), `disk-read`
the seconds the disk takes to read the whole folder once (`dlo warm`'s parallel reader, after
evicting it), `MODE@profile` one warm start under py-spy (attached by pid at spawn, every thread, PROFILE_S
seconds; its raw stacks beside the logs and a summary in the record, not in the figures; py-spy
needs ptrace rights over a sibling process, and a failed attach is only an `error` in the record), `MODE@cold[:N]` N
starts each after evicting the checkpoint (`os.sync`, `posix_fadvise(POSIX_FADV_DONTNEED)` per
file: no privilege needed; the residency left checked by `dlo.pagecache.residency`): what issue 34's
goal compares with one read of the folder, and `MODE@cold-node[:N]` N starts after dropping the
whole page cache as well (`drop_caches`, where allowed: a node whose Python libraries are cold
too, which a cold start reads besides the folder; a start where the drop was refused counts as a
checkpoint-cold one). A warm start finds the folder
in the page cache (read again first where a cold start left part of it out). Each start: the
default warm-up at its default size and default limits; the seconds from `Popen` to the first
`/ready` 200 (polled every `--poll-s`, 0.1 s: each poll costs the server ~2.5 ms of GIL-bound
Python, taken from the load beside it, so 20 ms polls slowed this host's tiny start by ~15%; a
kubelet probes every 1-10 s), the server's own `startup_seconds` (its phases: rank 0's load
steps, then the warm-up's) and the exit code of SIGTERM. `--check-output` sends one image request
twice after the first warm start of each mode (the bytes of every mode must agree; `check_seconds`
first and second: what first-call cost the warm-up left to the first client). The raw file is
rewritten after every step (a call cut short keeps what it measured), with the command, the package
set (optional packages installed, bytecode) and the host. `merge` joins raw files into
`<stem>.{json,md}` with its `summary`: `ready_seconds_median` and `ready_seconds_max` as {mode:
seconds}, the cold ones, `disk_read_seconds`, and `cold_extra_over_disk_read` as {mode: (cold
median - warm median) / seconds to read the folder once} (goal <= 1.0); the `node_cold_*` keys the
same for the starts after a whole page cache's drop.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform as host_platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.lib import records
from bench.startup_record import log_facts, merge, summarize
from bench import pipeline as pb
from bench.import_profile import bytecode_facts, optional_packages_installed

POLL_S = 0.1  # --poll-s's default
# mode name -> `dlo serve` flags; "{partial}": the headline offloaded run's resident blocks
# (bench.pipeline.RESIDENT_SHARE of Wan2.1's 40 blocks: 10)
MODES: dict[str, tuple[str, ...]] = {
    "resident": ("--mode", "resident"),  # what the policy picks on an H200 (the model fits)
    "rank-local": ("--mode", "rank-local", "--resident-blocks", "{partial}"),
    "allgather": ("--mode", "allgather", "--dp", "2"),  # two GPUs only
    # the warm-up at one step (A/B: the check request's first try against its second says whether
    # one step leaves the first client a first-call cost)
    "resident-warmup1": ("--mode", "resident", "--warmup-steps", "1"),
    "rank-local-warmup1": ("--mode", "rank-local", "--resident-blocks", "{partial}", "--warmup-steps", "1"),
    # the resident load as it was: pageable copies, the text encoder through diffusers
    "resident-pageable": ("--mode", "resident", "--no-register-early", "--no-stream-text-encoders"),
}
CHECK_REQUEST = {"kind": "image", "size": "1024x1024", "steps": 4, "guidance": 5.0}
TINY_CHECK_REQUEST = {"kind": "image", "size": "32x32", "steps": 2, "guidance": 5.0}


def model_files(model: Path) -> list[Path]:
    return sorted(model.rglob("*.safetensors"))


def evict(model: Path, whole_cache: bool = False) -> dict[str, Any]:
    """The checkpoint out of the page cache (no server maps it now: DONTNEED skips mapped pages);
    `whole_cache`: every other file's pages too, where the host allows it (`drop_caches`)."""
    from dlo.pagecache.residency import folder_residency

    os.sync()
    for f in model_files(model):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    dropped = False
    if whole_cache:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
            dropped = True
        except OSError:  # not allowed here: fadvise alone
            pass
    return {"drop_caches": dropped, "resident_ratio": round(folder_residency(model).ratio, 4)}


def disk_read(model: Path) -> dict[str, Any]:
    """Seconds to read the whole folder once from the disk (evicted first), with `dlo warm`'s
    parallel reader, then evicted again."""
    from dlo.pagecache.warm import warm

    before = evict(model)
    session = warm(model_files(model))
    out = {"seconds": round(session.seconds, 4), "bytes": session.after.bytes,
           "gb_per_s": round(session.after.bytes / max(session.seconds, 1e-9) / 1e9, 2), "evicted_before": before}
    out["evicted_after"] = evict(model)
    return out


def start_once(model: Path, flags: list[str], args: argparse.Namespace, label: str,
               check: dict | None, spy: Path | None = None) -> dict[str, Any]:
    """One `dlo serve` start to `/ready`, its startup figures, an optional request, SIGTERM; with
    `spy`, py-spy samples the server from its first milliseconds to PROFILE_S (raw stacks there)."""
    from dlo.serving.launch import ServerProcess

    log = args.logs / f"serve-{label}.log"
    srv = ServerProcess(model, "--device", args.device, *flags, log_path=log)
    out: dict[str, Any] = {"flags": flags}
    profiler = _profile_from_spawn(srv, spy) if spy is not None else None
    t0 = time.perf_counter()
    try:
        srv.start(ready_timeout_s=args.ready_timeout, poll_s=args.poll_s)
    except (RuntimeError, TimeoutError) as e:
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        out["error"] = f"{e}: {lines[-1] if lines else ''}"[-1500:]
        if profiler is not None:  # a failed start's profile is the one most wanted
            out["profile"] = profiler.join()
        out["exit_code"] = srv.stop()
        return out
    out["ready_seconds"] = round(time.perf_counter() - t0, 3)
    try:
        info = srv.ready_info()
        out.update(server_mode=info.get("mode"), warmup_seconds=info.get("warmup_seconds"),
                   warmup_size=info.get("warmup_size"), startup_seconds=info.get("startup_seconds"))
        if check is not None:
            from openai import OpenAI

            from bench.pipeline_requests import generate

            client = OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=300, max_retries=0)
            try:  # twice: a first request slower than the second is a first-call cost the warm-up left
                seconds, shas = [], []
                for _ in range(2):
                    t1 = time.perf_counter()
                    shas.append(hashlib.sha256(generate(client, check)).hexdigest())
                    seconds.append(round(time.perf_counter() - t1, 3))
                out.update(output_sha256=shas[0], check_seconds=seconds, check_same_bytes=len(set(shas)) == 1)
            except Exception as e:  # recorded: the starts after it still run
                out["check_error"] = f"{type(e).__name__}: {e}"[-1500:]
    finally:
        if profiler is not None:
            out["profile"] = profiler.join()
        out["exit_code"] = srv.stop()
    out.update(log_facts(log.read_text(errors="replace")))
    return out


# rank 0's lines only: every rank writes to the server's log
# "(W s of it waiting for the readahead to read the weights)"; before 2026-12-04 first "(F s of it
# waiting for the start's other files, W s for ...)", before that "(F s of it waiting ...)" alone
PROFILE_S = 16  # py-spy's duration: past ready (11-12 s on the H200), short of the request after it
SPAWN_WAIT_S = 30.0  # how long the profiler waits for the server's process to exist


def _profile_from_spawn(srv: Any, out: Path) -> Any:
    """Attach py-spy to `srv`'s process as soon as it is spawned, on a thread (`Background`): its
    `join()` is the summary once written, or `{"error": ...}` naming why there is none (every wait
    in it is bounded: the spawn, each attach, py-spy's run)."""
    from dlo.serving.prewarm import Background
    from bench.spy_profile import attach, summarize

    def work() -> dict[str, Any]:
        try:
            return attached()
        except Exception as e:  # recorded: the start's figures stand without a profile
            return {"error": f"{type(e).__name__}: {e}"[-500:]}

    def attached() -> dict[str, Any]:
        deadline = time.perf_counter() + SPAWN_WAIT_S
        while srv.proc is None and time.perf_counter() < deadline:
            time.sleep(0.001)
        if srv.proc is None:
            return {"error": "the server was not spawned"}
        started, attempts = time.perf_counter(), 0
        while True:  # in its first milliseconds the process may not be a Python interpreter yet
            attempts += 1
            spy = attach(srv.proc.pid, out, PROFILE_S)
            if spy is None:
                return {"error": "py-spy not found (PATH, or bin/py-spy beside a sys.path entry)"}
            try:
                _, err = spy.communicate(timeout=PROFILE_S + 30)
            except subprocess.TimeoutExpired:
                spy.kill()
                spy.wait()
                return {"error": f"py-spy ran past {PROFILE_S + 30} s and was killed"}
            if spy.returncode == 0 and out.exists():
                return {"raw": out.name, "attach_attempts": attempts, **summarize(out)}
            if time.perf_counter() - started > 3.0:
                return {"error": f"py-spy exited {spy.returncode}: {(err or '').strip()[-500:]}"}
            time.sleep(0.05)

    return Background("profile", work)


def mode_flags(mode: str, model: Path, args: argparse.Namespace) -> list[str]:
    partial = max(1, round(pb.RESIDENT_SHARE["wan21"] * pb.transformer_blocks(model)))
    flags = [f.format(partial=partial) for f in MODES[mode]]
    return flags + (["--small-limits"] if args.dry_run else [])  # the tiny model's limits


DEFAULT_PLAN = "resident:5,rank-local:5,disk-read,resident@cold:2,resident-pageable:2"
COLD_KINDS = ("cold", "cold-node")  # the checkpoint evicted; the whole page cache dropped
ASSUMED_DISK_BPS = 1e9  # the disk read's estimate before it ran (for --time-budget only)


def parse_plan(text: str) -> list[tuple[str, str, int]]:
    """`--plan` as (kind, mode, count) steps, kind one of warm, cold, cold-node, profile,
    disk-read; ValueError naming the item that is not one."""
    steps = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        if item == "disk-read":
            steps.append(("disk-read", "", 1))
            continue
        name, _, count = item.partition(":")
        mode, _, kind = name.partition("@")
        if mode not in MODES or kind not in ("", *COLD_KINDS, "profile") or not (count or "1").isdigit():
            raise ValueError(f"{item!r}: expected MODE[:N], MODE@cold[:N], MODE@cold-node[:N], MODE@profile or disk-read "
                             f"(modes: {', '.join(MODES)})")
        steps.append((kind or "warm", mode, int(count or 1)))
    return steps


def ensure_warm(model: Path) -> float:
    """The folder whole in the page cache before a warm start (`dlo warm`'s parallel reader); the
    seconds it took (0 when it was)."""
    from dlo.pagecache.residency import folder_residency
    from dlo.pagecache.warm import warm

    return 0.0 if folder_residency(model).ratio >= 0.999 else warm(model_files(model)).seconds


class Budget:
    """--time-budget: whether a step fits, from the longest of its kind so far (x 1.2)."""

    def __init__(self, seconds: float, t0: float):
        self.seconds, self.t0, self.longest = seconds, t0, {}

    def fits(self, kind: str, estimate: float = 0.0) -> bool:
        guess = 1.2 * max(self.longest.get(kind, 0.0), estimate)
        return not self.seconds or time.perf_counter() - self.t0 + guess <= self.seconds

    def took(self, kind: str, seconds: float) -> None:
        self.longest[kind] = max(self.longest.get(kind, 0.0), seconds)


def step_estimate(kind: str, rec: dict, budget: Budget) -> float:
    """Seconds a step of `kind` may take before one of its kind ran (the disk at ASSUMED_DISK_BPS;
    a cold start as a warm one plus one read of the folder)."""
    if kind == "disk-read":
        return rec["checkpoint_bytes"] / ASSUMED_DISK_BPS
    if kind in COLD_KINDS:
        return budget.longest.get("warm", 0.0) + rec.get("disk_read", {}).get("seconds", 0.0)
    return 0.0


def run(args: argparse.Namespace) -> None:
    preset, _ = (pb.TINY if args.dry_run else pb.MODELS)["wan21"]
    model = args.models / "wan21"
    args.logs.mkdir(parents=True, exist_ok=True)
    rec: dict[str, Any] = records.raw("startup", args.device, {
        "date": datetime.date.today().isoformat(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "host": host_platform.node(), "device": args.device, "optional_packages": optional_packages_installed(),
        "bytecode": bytecode_facts(), "preset": preset, "plan": args.plan,
        "make": pb.make(model, preset, None, args.device), "starts": [], "skipped_for_time": [],
    })
    rec["checkpoint_bytes"] = pb.checkpoint_bytes(model)
    rec["page_cache_warm_seconds"] = round(ensure_warm(model), 2)

    def save() -> None:
        records.write(rec, args.raw)

    save()
    budget, checked = Budget(args.time_budget, args.t0), set()
    for kind, mode, count in parse_plan(args.plan):
        for i in range(count):
            if not budget.fits(kind, step_estimate(kind, rec, budget)):
                rec["skipped_for_time"].append(f"{mode}@{kind}" if mode else kind)  # what fits is kept
                continue
            t_step = time.perf_counter()
            if kind == "disk-read":
                rec["disk_read"] = disk_read(model)
                print(f"disk read: {rec['disk_read']['seconds']} s ({rec['disk_read']['gb_per_s']} GB/s)", flush=True)
            else:
                check = args.check_output and kind == "warm" and mode not in checked
                run_start(rec, model, mode, kind, i, args, check)
                if check:
                    checked.add(mode)
            budget.took(kind, time.perf_counter() - t_step)
            save()
    save()
    print(json.dumps(summarize([rec]), indent=1))


def run_start(rec: dict, model: Path, mode: str, kind: str, i: int, args: argparse.Namespace, check: bool) -> None:
    """One start of the plan, appended to `rec["starts"]` (the page cache made cold or warm first;
    a `profile` start is a warm one under py-spy, left out of the figures)."""
    cold = kind in COLD_KINDS
    evicted = evict(model, whole_cache=kind == "cold-node") if cold else None
    rewarmed = None if cold else round(ensure_warm(model), 2)
    label = f"{mode}-{kind}-{i}"
    request = (TINY_CHECK_REQUEST if args.dry_run else CHECK_REQUEST) if check else None
    spy = args.logs / f"py-spy-{label}.txt" if kind == "profile" else None
    res = start_once(model, mode_flags(mode, model, args), args, label, request, spy)
    rec["starts"].append({"mode": mode, "start": i, "cold": cold, "profiled": spy is not None, "evicted": evicted,
                          "rewarm_seconds": rewarmed, **res})
    print(f"{label}: ready {res.get('ready_seconds')} s startup {res.get('startup_seconds')}"
          f"{' error ' + res['error'] if 'error' in res else ''}", flush=True)


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    ap = argparse.ArgumentParser(prog="python -m bench startup", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="start dlo serve repeatedly and record the seconds to /ready")
    r.add_argument("--models", type=Path, default=None,
                   help="folder of the wan21 pipeline, made if missing (default: /tmp/models; /tmp/tiny-models with --dry-run)")
    r.add_argument("--raw", type=Path, required=True, help="the raw record (rewritten after every start)")
    r.add_argument("--logs", type=Path, default=None, help="server logs (default: beside --raw)")
    r.add_argument("--plan", default=DEFAULT_PLAN,
                   help="comma-separated steps, in order: MODE[:N] warm starts, disk-read, MODE@cold[:N] cold starts "
                        f"(modes: {', '.join(MODES)}; default: {DEFAULT_PLAN})")
    r.add_argument("--check-output", action="store_true", help="one image request after each mode's first warm start")
    r.add_argument("--device", default="cuda")
    r.add_argument("--ready-timeout", type=float, default=120.0, help="seconds a start may take to /ready")
    r.add_argument("--poll-s", type=float, default=POLL_S,
                   help="seconds between /ready polls (each costs the loading server GIL time; default %(default)s)")
    r.add_argument("--time-budget", type=float, default=0.0, metavar="S",
                   help="start no step that would end more than S seconds after this process started (the longest "
                        "of its kind so far x 1.2); the skipped steps are listed in the record (0: no budget)")
    r.add_argument("--dry-run", action="store_true", help="tiny preset on cpu (every step, no figure is a result)")
    m = sub.add_parser("merge", help="join raw records into <stem>.{json,md} with a summary")
    m.add_argument("files", nargs="+")
    m.add_argument("--out", type=Path, default=Path("bench/results"))
    m.add_argument("--stem", required=True)
    args = ap.parse_args(argv)
    if args.cmd == "merge":
        return merge(args)
    try:
        parse_plan(args.plan)
    except ValueError as e:
        ap.error(f"--plan: {e}")
    if args.dry_run:
        args.device = "cpu"
    args.models = args.models or Path("/tmp/tiny-models" if args.dry_run else "/tmp/models")
    args.logs = args.logs or args.raw.parent / "logs"
    args.t0 = t0
    run(args)


if __name__ == "__main__":
    raise SystemExit(main())
