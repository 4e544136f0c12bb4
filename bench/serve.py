"""End to end through `dlo serve` and the official openai SDK: readiness, first request, waves, exit.

    bash bench/device.sh python -m bench serve --layers 12 --dim 2048 --dp 2 --raw $OUT/raw-serve.json   # 2 GPUs
    python -m bench serve --device cpu --layers 2 --dim 64 --size 64x64 --steps 2 --raw /tmp/s.json

Per configuration (resident dp1, then allgather and rank-local at --dp) one server is started:
- `ready_seconds` from start to `/ready` 200, and the warm-up the server reports in `/ready`;
- the first request after ready against the median of 5 warm single requests (`first_request_over_warm`);
- throughput of 8 sequential single requests against 8 waves of dp concurrent requests
  (`wave_throughput_over_single`);
- SHA256 of the PNG bytes per seed (identical across configurations is the claim);
- SIGTERM when idle: seconds until the whole process tree has exited, and the exit code.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import _env
from bench.lib import records
from bench.lib.stats import spread

_env.multicast_off()  # before torch: this process and what it spawns


def _client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0)


def _generate(client, args: argparse.Namespace, seed: int) -> tuple[float, str]:
    t0 = time.perf_counter()
    img = client.images.generate(prompt="a lighthouse at dusk", size=args.size, response_format="b64_json",
                                 extra_body={"seed": seed, "num_inference_steps": args.steps})
    dt = time.perf_counter() - t0
    return dt, hashlib.sha256(base64.b64decode(img.data[0].b64_json)).hexdigest()


def _exit_seconds(srv) -> tuple[float, int | None]:
    """SIGTERM the idle server; seconds until rank 0 and every child have exited."""
    import psutil

    parent = psutil.Process(srv.proc.pid)
    tree = [parent, *parent.children(recursive=True)]
    t0 = time.perf_counter()
    srv.proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=60)
    dt = time.perf_counter() - t0
    for p in alive:
        p.kill()
    rc = srv.proc.wait(timeout=10) if not alive else None
    return dt, rc


def run_config(args: argparse.Namespace, model: Path, mode: str, dp: int, log: Path) -> dict:
    from dlo.serving.launch import ServerProcess

    extra = ["--dp", str(dp), "--mode", mode, "--device", args.device]
    if args.warmup_size:
        extra += ["--warmup-size", args.warmup_size]
    srv = ServerProcess(model, *extra, log_path=log)
    t0 = time.perf_counter()
    srv.start(ready_timeout_s=420)
    out: dict = {"mode": mode, "dp": dp, "ready_seconds": time.perf_counter() - t0, "ready": srv.ready_info()}
    try:
        client = _client(srv.url)
        first, _ = _generate(client, args, 100)
        warm = [_generate(client, args, 101 + i)[0] for i in range(5)]
        t1 = time.perf_counter()
        singles = [_generate(client, args, 200 + i) for i in range(8)]
        t_single = time.perf_counter() - t1
        n = 8 * dp
        t1 = time.perf_counter()
        with ThreadPoolExecutor(dp) as pool:
            waves = list(pool.map(lambda s: _generate(client, args, s), range(300, 300 + n)))
        t_wave = time.perf_counter() - t1
        out.update(
            first_request_seconds=first, warm_seconds=warm, first_request_over_warm=first / statistics.median(warm),
            single_seconds=[d for d, _ in singles], sequential_throughput=8 / t_single,
            wave_request_seconds=[d for d, _ in waves], wave_throughput=n / t_wave,
            wave_throughput_over_single=(n / t_wave) / (8 / t_single),
            sha256={str(200 + i): h for i, (_, h) in enumerate(singles)} | {str(300 + i): h for i, (_, h) in enumerate(waves)},
            metrics={k: v for k, v in srv.metrics().items() if k.startswith(("dlo_host_pinned", "dlo_device", "dlo_wave_size"))},
        )
    finally:
        out["exit_seconds"], out["exit_code"] = _exit_seconds(srv)
    print(f"[{mode} dp{dp}] ready {out['ready_seconds']:.1f} s, first {out.get('first_request_seconds', 0):.3f} s vs "
          f"warm {statistics.median(out.get('warm_seconds') or [0]):.3f} s, waves x{out.get('wave_throughput_over_single', 0):.2f}, "
          f"exit {out['exit_seconds']:.1f} s rc={out['exit_code']}", flush=True)
    return out


def summarize(result: dict) -> dict:
    """The figures of the configurations that ran (`python -m bench serve --summarize --raw RAW` redoes
    it): each request latency with its spread (the first request after ready apart)."""
    ok = [c for c in result["configs"] if "error" not in c]
    ref = next((c["sha256"] for c in ok if c["mode"] == "resident"), None)
    return {
        "single_request_seconds": {f"{c['mode']}/dp{c['dp']}": spread(c["warm_seconds"] + c["single_seconds"],
                                                                      first=c["first_request_seconds"]) for c in ok},
        "wave_throughput_over_single": {f"{c['mode']}/dp{c['dp']}": c["wave_throughput_over_single"] for c in ok if c["dp"] > 1},
        "first_request_over_warm": {f"{c['mode']}/dp{c['dp']}": c["first_request_over_warm"] for c in ok},
        "warmup_seconds": {f"{c['mode']}/dp{c['dp']}": c["ready"].get("warmup_seconds") for c in ok},
        "ready_seconds": {f"{c['mode']}/dp{c['dp']}": c["ready_seconds"] for c in ok},
        "shutdown_seconds": {f"{c['mode']}/dp{c['dp']}": c["exit_seconds"] for c in result["configs"] if "exit_seconds" in c},
        "shutdown_exit_codes": {f"{c['mode']}/dp{c['dp']}": c["exit_code"] for c in result["configs"] if "exit_seconds" in c},
        # seeds both runs made (a dp-2 run makes 16 wave requests, dp 1 makes 8)
        "bytes_identical_to_resident_dp1": all(c["sha256"][k] == v for c in ok for k, v in ref.items()
                                               if k in c["sha256"]) if ref else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench serve", description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--size", default="512x512")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--warmup-size", default=None, help="dlo serve --warmup-size (default: the smallest valid size)")
    ap.add_argument("--configs", default="resident:1,allgather:DP,rank-local:DP")
    ap.add_argument("--raw", required=True)
    ap.add_argument("--summarize", action="store_true", help="only recompute the summary of an existing --raw")
    args = ap.parse_args(argv)
    if args.summarize:
        result = json.loads(Path(args.raw).read_text())
        result["summary"] = summarize(result)
        records.write(result, Path(args.raw))
        print(json.dumps(result["summary"], indent=1))
        return 0
    model = Path(f"/tmp/serve-wan-{args.layers}-{args.dim}")
    if not (model / "model_index.json").exists():
        subprocess.run([sys.executable, "-m", "dlo.cli.main", "make-tiny-model", str(model), "--family", "wan",
                        "--layers", str(args.layers), "--dim", str(args.dim), "--dtype", "bfloat16"], check=True)
    raw = Path(args.raw)
    raw.parent.mkdir(parents=True, exist_ok=True)
    result: dict = records.raw("serve", args.device, {"layers": args.layers, "dim": args.dim, "size": args.size,
                                                      "steps": args.steps, "configs": []})
    for spec in args.configs.split(","):
        mode, dp = spec.split(":")
        dp_n = args.dp if dp == "DP" else int(dp)
        try:
            result["configs"].append(run_config(args, model, mode, dp_n, raw.parent / f"serve-{mode}-dp{dp_n}.log"))
        except Exception as e:  # a failed configuration is a result too
            result["configs"].append({"mode": mode, "dp": dp_n, "error": f"{type(e).__name__}: {e}"[-600:]})
            print(f"[{mode} dp{dp_n}] failed: {e}", flush=True)
        result["summary"] = summarize(result)  # after every configuration: a call cut short keeps one
        records.write(result, raw)
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
