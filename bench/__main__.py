"""`python -m bench SUITE ...`: the one entry of the benchmarks.

    python -m bench                  # the suites and tools, one line each
    python -m bench SUITE --help     # a suite's commands (run, merge, ...)
    bash bench/device.sh python -m bench SUITE run ...   # on the GPU host: the lock's package set

Owns: `SUITES` (name -> module and what it answers) and the dispatch: a suite's module is imported
only when it runs (a suite's imports never slow another's start).
Must never: hold a suite's logic.
"""

from __future__ import annotations

import importlib
import sys

SUITES: dict[str, tuple[str, str]] = {
    "offload": ("bench.offload", "one GPU: DLO against resident, diffusers' group offloading and accelerate, at the physical bound"),
    "multi-gpu": ("bench.multi_gpu", "dp ranks on N GPUs: pooled host links, waves of dp requests, graphs, memory, the policy's choice"),
    "sp": ("bench.sp", "sequence parallelism (Ulysses) with offload on 2 GPUs, against resident and dp2 waves"),
    "hsdp": ("bench.hsdp", "HSDP (FSDP2 + Ulysses), the published multi-GPU baseline, against DLO on N GPUs"),
    "fp8-drift": ("bench.fp8_drift", "FP8 streaming's drift from bfloat16, per family (CPU tiny presets, or real widths on the GPU)"),
    "fetch": ("bench.fetch", "dlo fetch from an S3-compatible store on loopback: seconds, a complete folder again, a killed fetch resumed"),
    "pipeline": ("bench.pipeline", "full-size pipelines through dlo serve against plain diffusers; --small-gpu: under a cap, FP8"),
    "memory": ("bench.memory", "device-memory calibration per family and shape; merge fits plan/memory_table.json"),
    "startup": ("bench.startup", "seconds from process start to /ready, warm and cold page cache, per mode"),
    "imports": ("bench.import_profile", "where a dlo serve process's import seconds go (no GPU, no model)"),
    "seed-models": ("bench.seed_models", "Cosmos3 and MiniMax-H3 through dlo serve against plain diffusers: videos/h, Wh/video"),
    "lora": ("bench.lora", "a rank-64 LoRA adapter per request: per block and end to end, resident and streamed"),
    "exact": ("bench.exact_device", "every default, resident and under a 24 GiB cap, against diffusers: bytes and seconds"),
    "step-cache": ("bench.step_cache", "TaylorSeer and First Block Cache served, resident and capped, against uncached and diffusers' own"),
    "peer-check": ("bench.peer_check", "peer gathers (CUDA IPC copies, no collective): bytes identical, seconds per call"),
    "serve": ("bench.serve", "dlo serve through the openai SDK: ready, first request, waves against sequential, exit"),
    "lora-kernel": ("bench.lora_merge_kernel", "the one-pass LoRA merge kernel against peft's two steps: time and bytes per shape"),
    "cold-start": ("bench.cold_start", "the cold-start host-memory peak of dlo serve in a memory cgroup of its own"),
    "load": ("bench.load_tiny", "N requests at concurrency C against a tiny dlo serve on CPU: nothing lost, latency, no leak"),
    "reliability": ("bench.reliability_faults", "fault isolation, drain and connection floods of dlo serve (CPU, tiny model)"),
    "attacks": ("bench.reliability_attacks", "the hardening attacks against dlo agent and dlo serve, before and after a change"),
    "tests": ("bench.suite_times", "the test suite's wall time: every test and the quick subset (CPU)"),
    "operator-fleet": ("bench.operator_fleet", "the operator's API calls, reconciles and CPU on an emulated fleet of 1,000 nodes"),
}
TOOLS: dict[str, tuple[str, str]] = {
    "stamp": ("bench.tools", "write .whl/SOURCE.json: the commit a copy of the tree without git records"),
    "lock": ("bench.lockfile", "resolve requirements/engine.in into requirements/engine.lock (pins and hashes)"),
    "wheels": ("bench.lockfile", "the lock's wheels for the device (cp312) into .whl/, with the stamp"),
    "readme": ("bench.readme", "rewrite (or --check) the README's figures block from the newest records"),
    "cards": ("bench.lib.cards", "rewrite bench/results/CARDS.json: each result's card and how it was told"),
}


def usage() -> str:
    width = max(map(len, [*SUITES, *TOOLS]))
    lines = ["usage: python -m bench SUITE|TOOL [args...]", "", "suites:"]
    lines += [f"  {n:<{width}}  {what}" for n, (_, what) in SUITES.items()]
    lines += ["", "tools:"] + [f"  {n:<{width}}  {what}" for n, (_, what) in TOOLS.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    entry = SUITES.get(name) or TOOLS.get(name)
    if entry is None:
        print(f"python -m bench: no suite or tool {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(entry[0])
    if name in TOOLS:
        return int(module.main(name, rest) or 0)
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
