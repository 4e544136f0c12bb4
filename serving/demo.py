"""Demo: a tiny Wan model served by 2 CPU ranks in allgather mode, one wave of 2 requests.

Makes a tiny random Wan pipeline, starts `dlo serve` with 2 ranks, sends 2 concurrent image
requests with the official openai SDK (they run as one wave), writes the PNGs to the output folder,
prints a short report (wave size, per-rank pinned bytes, mode, latency) and stops the server.

Owns: `dlo demo` (what `make demo` runs). Must never: download anything or leave the server running.
"""

from __future__ import annotations

import argparse
import base64
import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dlo.cli.args import positive_int
from dlo.plan.facts import MODES
from dlo.plan.limits import SMALL

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=Path("demo-output"), help="folder for the model, PNGs and log")
    parser.add_argument("--dp", type=positive_int, default=2, help="CPU ranks (one request each)")
    parser.add_argument("--mode", default="allgather", choices=MODES)
    parser.add_argument("--steps", type=positive_int, default=4,
                        help=f"denoising steps per request, 1 to {SMALL.max_steps} (the small limits the demo serves)")
    parser.add_argument("--size", default="128x128",
                        help=f"image size WIDTHxHEIGHT, multiples of 16 up to {SMALL.max_width}x{SMALL.max_height}")


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _flag_problem(args: argparse.Namespace) -> str | None:
    """Why the flags ask what the demo's server refuses (the small limits, the tiny Wan model's
    sizes), or None: checked before anything is made or started."""
    from dlo.engine.families import FAMILIES
    from dlo.engine.families.tiny import transformer_config
    from dlo.serving.api_models import ApiError, parse_size

    if args.steps > SMALL.max_steps:
        return f"--steps {args.steps}: the demo serves the small limits, at most {SMALL.max_steps} steps"
    # the facts of the model `main` makes (`make_tiny_transformer`'s defaults; its VAE scales by 8)
    facts = FAMILIES["wan"].pipeline_facts(Path("tiny-wan"), {}, transformer_config("wan", 3, 32), {})
    try:
        parse_size(args.size, facts, SMALL)
    except ApiError as e:
        return f"--size: {e.message}"
    return None


def main(args: argparse.Namespace) -> int:
    if (problem := _flag_problem(args)) is not None:
        print(f"dlo demo: {problem}", file=sys.stderr)
        return 2
    from dlo.serving.library_noise import quiet_libraries

    quiet_libraries()  # the model's writing and the server it starts: progress bars on a terminal only
    # our lines at INFO, the libraries' at WARNING: the openai SDK's HTTP client (httpx) logs every request
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("dlo").setLevel(logging.INFO)
    from openai import OpenAI

    from dlo.serving.launch import ServerProcess
    from dlo.engine.families.tiny import make_tiny_transformer, write_pipeline_components

    out: Path = args.out.resolve()
    model = out / "tiny-wan"
    t0 = time.perf_counter()
    if not (model / "model_index.json").exists():
        make_tiny_transformer(model / "transformer", "wan")
        write_pipeline_components(model, family="wan")
    print(f"model      {model} (made in {time.perf_counter() - t0:.1f} s)")
    t1 = time.perf_counter()
    srv = ServerProcess(model, "--dp", str(args.dp), "--mode", args.mode, "--device", "cpu", "--small-limits",
                        "--wave-window-ms", "200", log_path=out / "serve.log")
    prompts = ["a lighthouse at dusk", "a red bicycle in the snow"][: args.dp] or ["a lighthouse at dusk"]
    with srv:
        print(f"server     {srv.url} ready in {time.perf_counter() - t1:.1f} s (log: {out / 'serve.log'})")
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused")

        def one(i: int) -> tuple[int, float, bytes]:
            s = time.perf_counter()
            r = client.images.generate(model=model.name, prompt=prompts[i], size=args.size, response_format="b64_json",
                                       extra_body={"seed": 1000 + i, "num_inference_steps": args.steps})
            return i, time.perf_counter() - s, base64.b64decode(r.data[0].b64_json or "")

        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(one, range(len(prompts))))
        m = srv.metrics()
        info = srv.ready_info()
    code = srv.proc.returncode if srv.proc else None
    for i, seconds, png in results:
        path = out / f"image-{i}.png"
        path.write_bytes(png)
        print(f"request {i}  {seconds:.2f} s  {len(png)} bytes -> {path}")
    waves = m.get("dlo_wave_size_count", [({}, 0)])[0][1]
    total = m.get("dlo_wave_size_sum", [({}, 0)])[0][1]
    print(f"mode       {info['mode']}, dp {info['dp']}")
    print(f"waves      {waves:.0f} (requests per wave: {total / max(waves, 1):.1f})")
    for labels, value in sorted(m.get("dlo_host_pinned_bytes", []), key=lambda x: x[0]["rank"]):
        print(f"rank {labels['rank']}     {labels['source']} {_mib(value)} host-pinned shard bytes")
    for r in info["ranks"]:
        rep = r["report"]
        print(f"rank {r['rank']}     model {_mib(rep['model_bytes'])}, host weights {_mib(rep['host_pinned_bytes'] or 0)} "
              f"(pinned={rep['pinned']}), slots {_mib(rep['slot_bytes'])}, text encoder + VAE "
              f"{_mib(sum(r['components'].values()))}")
    print(f"total      {time.perf_counter() - t0:.1f} s; server exit code {code}")
    return 0 if code == 0 and len(results) == len(prompts) else 1
