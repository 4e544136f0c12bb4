"""Load benchmark: N image requests at concurrency C against a real `dlo serve` (tiny Wan model, CPU).

Checks that every request is answered 200, 429 or 503 (zero lost: no connection error or timeout;
zero 5xx other than 503), reports p50/p99 latency, and samples RSS and PSS of every rank before
(after a warm-up), during and after the run: growth of any rank beyond `--rss-bound-mib` fails the
run as a leak. The server's own `dlo_requests_total` must agree with what the clients saw.

    python -m bench load                          # 1,000 requests, concurrency 16, dp 2, small limits
    python -m bench load --requests 60 --out /tmp/x --name smoke

Writes <out>/<name>.json and <name>.md (the command, the figures). Exit code 1 if any check fails.
A benchmark, not a CI test (tests/reliability/test_load_tiny.py runs a scaled-down version).
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests

from bench.lib import records
from dlo.serving.launch import ServerProcess

MIB = 1024 * 1024
ENDPOINT = "/v1/images/generations"


def body(i: int) -> dict:
    """A deterministic mix of compatibility keys (size x steps x n), so waves form and split."""
    return {"prompt": f"load request {i}", "seed": i, "size": ("32x32", "64x64")[i % 2],
            "num_inference_steps": 1 + (i // 2) % 2, "n": 2 if i % 10 == 9 else 1}


def rank_memory(pid: int) -> list[dict]:
    """RSS and PSS of rank 0 (`pid`) and every child rank."""
    root = psutil.Process(pid)
    out = []
    for rank, p in enumerate([root, *root.children(recursive=True)]):
        m = p.memory_full_info()
        out.append({"rank": rank, "pid": p.pid, "rss_bytes": m.rss, "pss_bytes": m.pss})
    return out


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def second_half(trace: list[dict], after: list[dict], n: int) -> list[int]:
    """RSS growth of each rank from the sample nearest the halfway point to the end."""
    if not trace:
        return [0 for _ in after]
    mid = min(trace, key=lambda t: abs(t["answered"] - n / 2))
    return [a["rss_bytes"] - m for a, m in zip(after, mid["rss_bytes"])]


def one(session: requests.Session, url: str, i: int, timeout: float) -> dict:
    t0 = time.perf_counter()
    try:
        r = session.post(url + ENDPOINT, json=body(i), timeout=timeout)
        status, error = r.status_code, None
        if status == 200:
            assert len(r.json()["data"]) == body(i)["n"]
    except (requests.RequestException, ValueError, AssertionError) as e:  # lost: no usable answer
        status, error = None, repr(e)[:200]
    return {"i": i, "status": status, "seconds": time.perf_counter() - t0, "error": error}


def run(args: argparse.Namespace) -> dict:
    model = args.model
    if model is None:
        from dlo.engine.families.tiny import make_tiny_transformer, write_pipeline_components

        model = Path(tempfile.mkdtemp(prefix="dlo-load-")) / "tiny-wan"
        make_tiny_transformer(model / "transformer", "wan", dtype="float32")
        write_pipeline_components(model, family="wan", dtype="float32")
    serve_args = ["--dp", str(args.dp), "--mode", "allgather" if args.dp > 1 else "rank-local", "--device", "cpu",
                  "--small-limits", "--max-queue", str(args.max_queue)]
    log = Path(tempfile.mkdtemp(prefix="dlo-load-log-")) / "serve.log"
    srv = ServerProcess(model, *serve_args, log_path=log)
    t_start = time.perf_counter()
    srv.start()
    start_seconds = time.perf_counter() - t_start
    assert srv.proc is not None
    local = threading.local()
    answered = [0]

    def call(i: int) -> dict:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        res = one(local.session, srv.url, i, args.timeout)
        answered[0] += 1
        if res["status"] == 429:
            time.sleep(args.backoff_429)
        return res

    try:
        # warm-up at the run's concurrency, capped at the queue limit (a finished client may resubmit
        # before the next wave leaves the queue), every key on every rank: the first waves at full
        # concurrency grow the allocators' pools once
        with ThreadPoolExecutor(min(args.concurrency, args.max_queue)) as pool:
            warm = list(pool.map(call, range(args.requests, args.requests + args.warmup)))
        assert all(w["status"] == 200 for w in warm), f"warm-up failed: {warm}"
        answered[0] = 0
        mem_before = rank_memory(srv.proc.pid)
        peak = {m["rank"]: m["rss_bytes"] for m in mem_before}
        trace: list[dict] = []  # RSS of every rank against requests answered: a leak climbs, warm-up levels off
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(1.0):
                mem = rank_memory(srv.proc.pid)  # type: ignore[union-attr]
                trace.append({"answered": answered[0], "rss_bytes": [m["rss_bytes"] for m in mem]})
                for m in mem:
                    peak[m["rank"]] = max(peak[m["rank"]], m["rss_bytes"])

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(call, range(args.requests)))
        wall = time.perf_counter() - t0
        stop.set()
        sampler.join()
        mem_after = rank_memory(srv.proc.pid)
        healthy = srv.get("/health")[0]
        counted: dict[str, float] = {}
        for labels, value in srv.metrics().get("dlo_requests_total", []):
            if labels.get("endpoint") == ENDPOINT:
                counted[labels["code"]] = counted.get(labels["code"], 0) + value
    finally:
        exit_code = srv.stop()

    codes: dict[str, int] = {}
    for r in results:
        codes[str(r["status"])] = codes.get(str(r["status"]), 0) + 1
    lost = [r for r in results if r["status"] is None]
    bad_5xx = [r for r in results if r["status"] is not None and r["status"] >= 500 and r["status"] != 503]
    unexpected = [r for r in results if r["status"] not in (None, 200, 429, 503) and r["status"] < 500]
    ok = [r["seconds"] for r in results if r["status"] == 200]
    every = [r["seconds"] for r in results if r["status"] is not None]
    growth = {b["rank"]: {"rss_bytes": a["rss_bytes"] - b["rss_bytes"], "pss_bytes": a["pss_bytes"] - b["pss_bytes"]}
              for b, a in zip(mem_before, mem_after)}
    bound = args.rss_bound_mib * MIB
    leak = {r: g for r, g in growth.items() if g["rss_bytes"] > bound or g["pss_bytes"] > bound}
    warm_counted = {"200": float(args.warmup)}
    server_agrees = all(counted.get(code, 0) - warm_counted.get(code, 0) == n
                        for code, n in codes.items() if code != "None")
    checks = {
        "zero_lost": not lost, "zero_5xx_other_than_503": not bad_5xx, "only_200_429_503": not unexpected,
        "memory_growth_within_bound": not leak, "server_counts_agree": server_agrees,
        "healthy_after": healthy == 200, "clean_exit": exit_code == 0,
    }
    return {
        "date": dt.date.today().isoformat(),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "serve_args": serve_args,
        "requests": args.requests, "concurrency": args.concurrency, "dp": args.dp, "max_queue": args.max_queue,
        "backoff_429_seconds": args.backoff_429,
        "warmup_requests": args.warmup, "cpu_count": psutil.cpu_count(), "server_start_seconds": round(start_seconds, 2),
        "wall_seconds": round(wall, 2), "throughput_rps": round(len(results) / wall, 2),
        "status_counts": codes, "lost": len(lost), "lost_examples": lost[:5], "non_503_5xx": len(bad_5xx),
        "server_counted": counted,
        "latency_200_seconds": {"p50": round(percentile(ok, 0.5), 4), "p99": round(percentile(ok, 0.99), 4),
                                "max": round(max(ok, default=float("nan")), 4),
                                "mean": round(statistics.fmean(ok), 4) if ok else None},
        "latency_all_seconds": {"p50": round(percentile(every, 0.5), 4), "p99": round(percentile(every, 0.99), 4)},
        "memory_before": mem_before, "memory_after": mem_after, "rss_peak_bytes": [peak[r] for r in sorted(peak)], "growth": growth,
        "rss_trace": trace, "rss_growth_second_half_bytes": second_half(trace, mem_after, args.requests),
        "rss_bound_mib": args.rss_bound_mib, "checks": checks, "passed": all(checks.values()),
    }


def markdown(res: dict) -> str:
    lat, all_lat = res["latency_200_seconds"], res["latency_all_seconds"]
    rows = "\n".join(
        f"| {b['rank']} | {b['rss_bytes'] / MIB:.1f} | {a['rss_bytes'] / MIB:.1f} | "
        f"{res['rss_peak_bytes'][b['rank']] / MIB:.1f} | "
        f"{b['pss_bytes'] / MIB:.1f} | {a['pss_bytes'] / MIB:.1f} | "
        f"{(a['rss_bytes'] - b['rss_bytes']) / MIB:+.1f} | {(a['pss_bytes'] - b['pss_bytes']) / MIB:+.1f} |"
        for b, a in zip(res["memory_before"], res["memory_after"])
    )
    checks = "\n".join(f"- {'PASS' if v else 'FAIL'} {k}" for k, v in res["checks"].items())
    return f"""# Load: {res['requests']} requests at concurrency {res['concurrency']} against `dlo serve` (tiny Wan, CPU, dp {res['dp']})

Date {res['date']}, {res['cpu_count']} CPU cores (shared). Command:

```bash
{res['command']}
```

Server: `dlo serve TINY {' '.join(res['serve_args'])}` (small-limits profile). Request mix: sizes 32x32 and
64x64, 1 or 2 steps, every tenth request n=2 (several compatibility keys, so waves form and split);
{res['warmup_requests']} warm-up requests before the first memory sample, not counted. A client that gets a 429
waits {res['backoff_429_seconds']} s before its next request (the 429 is that request's answer; no retries).

| figure | value |
|---|---|
| answered by status | {', '.join(f'{k}: {v}' for k, v in sorted(res['status_counts'].items()))} |
| lost (no HTTP answer) | {res['lost']} |
| 5xx other than 503 | {res['non_503_5xx']} |
| server's `dlo_requests_total` (incl. warm-up) | {', '.join(f'{k}: {v:g}' for k, v in sorted(res['server_counted'].items()))} |
| latency of 200s p50 / p99 / max | {lat['p50'] * 1000:.0f} / {lat['p99'] * 1000:.0f} / {lat['max'] * 1000:.0f} ms |
| latency of all answers p50 / p99 | {all_lat['p50'] * 1000:.0f} / {all_lat['p99'] * 1000:.0f} ms |
| wall time, throughput | {res['wall_seconds']} s, {res['throughput_rps']} requests/s |
| server start (to /ready 200) | {res['server_start_seconds']} s |

Memory per rank (MiB; before = after warm-up, peak = highest RSS sampled every second during the run).
Bound: neither RSS nor PSS of any rank may grow by more than {res['rss_bound_mib']} MiB from before to after.
RSS growth over the second half of the run (a leak keeps climbing; allocator warm-up levels off):
{', '.join(f'rank {r}: {g / MIB:+.1f} MiB' for r, g in enumerate(res['rss_growth_second_half_bytes']))}.

| rank | RSS before | RSS after | RSS peak | PSS before | PSS after | RSS growth | PSS growth |
|---|---|---|---|---|---|---|---|
{rows}

Checks:
{checks}
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench load", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--max-queue", type=int, default=64,
                   help="the server's --max-queue (its default); below concurrency - dp some requests get 429")
    p.add_argument("--backoff-429", type=float, default=0.05,
                   help="seconds a client waits after a 429 before its next request (a 429 is that request's answer)")
    p.add_argument("--warmup", type=int, default=40,
                   help="requests before the first memory sample (all must be 200); 40 cover every key several times")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request client timeout: past it a request is lost")
    p.add_argument("--rss-bound-mib", type=float, default=32.0, help="largest RSS or PSS growth of any rank")
    p.add_argument("--model", type=Path, default=None, help="a tiny pipeline folder (default: make one)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--name", default=None, help="file stem (default: load-tiny-<date>)")
    args = p.parse_args(argv)
    res = records.raw("load", "cpu", run(args))
    stem = args.name or f"load-tiny-{res['date']}"
    records.write(res, args.out / f"{stem}.json", markdown(res))
    print(markdown(res))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
