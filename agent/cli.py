"""Subcommands owned by the agent: `dlo agent`, `dlo warm`, `dlo plan` (docs/contracts.md section 2).

Owns: argument parsing, human output (progress bars) and exit codes of `dlo agent` and `dlo warm`,
and the dispatch to `dlo plan` (dlo.agent.plan_cli). Bad input is one line on stderr and exit 2
(`dlo.cli.args`). The work lives in dlo.agent.node (with dlo.agent.pods, dlo.agent.collector,
dlo.agent.server) and dlo.pagecache.warm.
Must never: import torch.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from dlo.cli.args import (
    Parser,
    existing_dir,
    existing_file,
    existing_path,
    fail,
    http_url,
    port,
    positive_int,
    positive_seconds,
    ratio,
)
from dlo.cli.logs import LogFormat, add_log_format_argument, configure_logging, env_log_format, say

# The agent's port, the chart's `agent.port`: not 9400, which dcgm-exporter serves on the same nodes.
DEFAULT_PORT = 9435


def run(command: str, argv: list[str]) -> int:
    from dlo.agent.plan_cli import run_plan

    handlers = {"agent": run_agent, "warm": run_warm, "plan": run_plan}
    if command not in handlers:
        print(f"dlo: {command!r} is not an agent command", file=sys.stderr)
        return 2
    _log_to_stderr(env_log_format())  # `dlo plan`'s, and the others' until their --log-format is read
    return handlers[command](argv)


def _log_to_stderr(fmt: LogFormat) -> None:
    """One record, one line (text, control characters escaped) or one JSON object (`dlo.cli.logs`)."""
    configure_logging(fmt, os.environ.get("DLO_LOG_LEVEL", "INFO"))


def _stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT (installed before we announce that we wait for it)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


class _ProgressLines:
    """Plain progress lines (bytes, rate, ETA) at most every `every_s` seconds."""

    def __init__(self, total: int, emit: Callable[[str], None], every_s: float = 5.0):
        self.total, self.emit, self.every_s = total, emit, every_s
        self.done = 0
        self.start = self.last = time.monotonic()

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last < self.every_s:
            return
        self.last = now
        rate = self.done / max(now - self.start, 1e-9)
        eta = (self.total - self.done) / rate if rate else float("inf")
        self.emit(
            f"warming {self.done / 1e9:.2f} / {self.total / 1e9:.2f} GB, {rate / 1e9:.2f} GB/s, ETA {eta:.0f} s"
        )


# --- dlo warm --------------------------------------------------------------------------------


def warm_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="dlo warm",
        description=(
            "Bring model files into the OS page cache before an engine maps them. Every *.safetensors "
            "file under each PATH is mapped read-only, advised WILLNEED and read in parallel; then its "
            "page-cache residency is measured (cachestat, else mincore). Exits 0 only when every file "
            "is at least --threshold resident, 1 when one is not, 2 on bad input. The process that "
            "warms is charged for the pages (its memory cgroup): see docs/agent.md."
        ),
        epilog="example: dlo warm /models/wan2.1-14b --threshold 0.99 --json",
    )
    p.add_argument("paths", nargs="+", metavar="PATH", type=existing_path, help="a model folder or a safetensors file")
    p.add_argument("--threshold", type=ratio, default=0.99, help="residency every file must reach, 0..1 (default 0.99)")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout (no progress bar)")
    p.add_argument(
        "--lock", action="store_true",
        help="mlock the files and keep running until SIGTERM/SIGINT, so the pages cannot be evicted",
    )
    p.add_argument("--threads", type=positive_int, default=None,
                   help="parallel readers, at least 1 (default: 4 per CPU, at most 32)")
    add_log_format_argument(p)
    return p


def run_warm(argv: list[str]) -> int:
    args = warm_parser().parse_args(argv)
    _log_to_stderr(args.log_format)
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    from dlo.pagecache.residency import ResidencyError, model_files
    from dlo.pagecache.tree import FolderTooDeep
    from dlo.pagecache.warm import warm

    err = Console(stderr=True)
    for p in args.paths:  # a folder's walk takes only *.safetensors files; a file named must be one too
        if p.is_file() and not p.name.endswith(".safetensors"):
            return fail("dlo warm", f"{p}: not a safetensors file (give a model folder or *.safetensors files)")
    try:
        files = [f for p in args.paths for f in model_files(p)]
        total = sum(f.stat().st_size for f in files)
    except (OSError, ResidencyError) as e:
        return fail("dlo warm", e)
    except FolderTooDeep:  # the walk is iterative: no RecursionError to catch
        return fail("dlo warm", f"{', '.join(map(str, args.paths))}: a folder tree too deep to walk")
    if not files:
        return fail("dlo warm", f"no *.safetensors file under {', '.join(map(str, args.paths))}")
    progress = Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        TimeRemainingColumn(), console=err, disable=args.json or not err.is_terminal,
    )
    # Without a terminal (an init container's log), a line every few seconds instead of a bar.
    lines = None if args.json or err.is_terminal else _ProgressLines(total, lambda line: err.print(line))
    try:
        with progress:
            task = progress.add_task("warming", total=total)

            def advance(n: int) -> None:
                progress.advance(task, n)
                if lines is not None:
                    lines.advance(n)

            session = warm(
                args.paths, threads=args.threads, threshold=args.threshold, lock=args.lock, progress=advance,
            )
    except (OSError, ResidencyError, ValueError) as e:
        return fail("dlo warm", e)
    broken = _broken_file(files)  # after the warm: reading the headers first would change `ratio_before`
    if broken is not None:
        session.close()
        return fail("dlo warm", broken)
    report = session.report()
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for f in report["files"]:
            err.print(f"{f['ratio']:7.2%}  {f['bytes'] / 1e9:8.2f} GB  {f['path']}")
        rate = report["bytes"] / report["seconds"] / 1e9 if report["seconds"] else float("inf")
        err.print(
            f"{'ok' if report['ok'] else 'BELOW THRESHOLD'}: {report['ratio']:.2%} of {report['bytes'] / 1e9:.2f} GB "
            f"resident in {report['seconds']:.1f} s ({rate:.2f} GB/s), threshold {args.threshold:.2%}"
        )
    if args.lock:
        stop = _stop_on_signals()
        err.print("holding the locked pages until SIGTERM or SIGINT")
        stop.wait()
        session.close()
    return 0 if session.ok else 1


def _broken_file(files: list[Path]) -> str | None:
    """Why one of `files` is no safetensors file an engine can load (a 0-byte or cut file, a bad
    header: warming it would report success for a model that cannot serve), or None."""
    from dlo.agent.modelcheck import file_error

    for f in files:
        err = file_error(f)
        if err is not None:
            return f"{err.message} ({err.reason})"
    return None


# --- dlo agent -------------------------------------------------------------------------------


def agent_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="dlo agent",
        description=(
            "Run the node agent: serves /metrics (Prometheus, dlo_* agent metrics), /profile (this "
            "node's NodeProfile JSON) and /health. It reads /proc and the cgroup tree (read-only), "
            "scrapes each engine's dlo_host_pinned_bytes, and in a cluster publishes the profile as "
            "node annotation dlo.dev/node-profile. Run with hostPID and read-only host mounts of "
            "/proc and /sys/fs/cgroup (pass them with --proc-root/--cgroup-root)."
        ),
        epilog="example: dlo agent --port 9435 --models-root /models --engine-url http://127.0.0.1:8000",
    )
    p.add_argument("--port", type=port, default=DEFAULT_PORT,
                   help=f"HTTP port (default {DEFAULT_PORT}; not 9400, dcgm-exporter's; 0 picks a free one)")
    p.add_argument("--host", default=None,
                   help="listen address (default: 0.0.0.0 in a cluster, the pod's own addresses; 127.0.0.1 "
                        "outside one, so that node memory facts are not offered to the whole network)")
    p.add_argument("--max-connections", type=positive_int, default=256,
                   help="open HTTP connections at most (default 256; 32 from one client address); beyond, a "
                        "connection gets 503 at once. A connection must send its request head within 5 s")
    p.add_argument("--node-name", default=os.environ.get("NODE_NAME") or socket.gethostname(),
                   help="this node's name (default: $NODE_NAME, else the host name)")
    p.add_argument("--models-root", type=existing_dir, help="folder whose sub-folders are models (facts, residency)")
    p.add_argument("--proc-root", type=existing_dir, default=Path("/proc"), help="host /proc (default /proc)")
    p.add_argument("--cgroup-root", type=existing_dir, default=Path("/sys/fs/cgroup"), help="host cgroup root")
    p.add_argument("--sys-root", type=existing_dir, default=Path("/sys"), help="host /sys for PCIe and NUMA (default /sys)")
    p.add_argument("--engine-url", action="append", default=[], metavar="URL", type=http_url,
                   help="an engine to scrape outside Kubernetes (repeatable), e.g. http://127.0.0.1:8000")
    p.add_argument("--calibration", type=existing_file, metavar="FILE", help="a `dlo calibrate` fragment (measured bandwidths)")
    p.add_argument("--kubernetes", choices=("auto", "on", "off"), default="auto",
                   help="find pods and publish the profile through the API (auto: when in a cluster)")
    p.add_argument("--publish-interval", type=positive_seconds, default=60.0, help="seconds between profile checks (default 60)")
    p.add_argument("--warm", action="store_true", help="keep every model under --models-root warm (agent warming)")
    p.add_argument("--warm-threshold", type=ratio, default=0.99, help="residency that triggers a re-warm, 0..1")
    p.add_argument("--warm-interval", type=positive_seconds, default=300.0, help="seconds between residency checks (default 300)")
    add_log_format_argument(p)
    return p


def run_agent(argv: list[str]) -> int:
    parser = agent_parser()
    args = parser.parse_args(argv)
    if not args.node_name.strip():
        parser.error("--node-name must not be empty (set it, or $NODE_NAME)")
    _log_to_stderr(args.log_format)
    from dlo.agent.node import Agent, AgentConfig, publish_loop, warm_loop
    from dlo.agent.podwatch import PodWatch
    from dlo.agent.pods import KubernetesPods
    from dlo.agent.server import Limits, serve

    use_k8s = args.kubernetes == "on" or (args.kubernetes == "auto" and "KUBERNETES_SERVICE_HOST" in os.environ)
    cfg = AgentConfig(
        node_name=args.node_name, models_root=args.models_root, proc_root=args.proc_root,
        cgroup_root=args.cgroup_root, sys_root=args.sys_root, engine_urls=args.engine_url,
        calibration=args.calibration, kubernetes=use_k8s, warm=args.warm, warm_threshold=args.warm_threshold,
        pods_ttl_s=0.0,  # the watch keeps the pods current: a scrape reads them from memory
    )
    try:
        pods = KubernetesPods(args.node_name) if use_k8s else None
        watch = PodWatch(pods) if pods is not None else None
        agent = Agent(cfg, pods=watch)
        host = args.host or ("0.0.0.0" if use_k8s else "127.0.0.1")
        server = serve(agent, host, args.port, Limits(max_connections=args.max_connections,
                                                     per_address=min(32, args.max_connections)))
    except (OSError, ValueError) as e:
        return fail("dlo agent", e)
    stop = _stop_on_signals()
    agent.start_model_loop(stop)  # model folders are scanned here, never on a scrape
    if watch is not None:
        watch.start(stop)  # one listing, then a watch: no scrape lists pods
    threads = []
    if pods is not None:
        threads.append(threading.Thread(target=publish_loop, args=(agent, pods.annotate_node, stop,
                                                                   args.publish_interval), daemon=True))
    if args.warm:
        threads.append(threading.Thread(target=warm_loop, args=(agent, stop, args.warm_interval), daemon=True))
    for t in threads:
        t.start()
    say(f"dlo agent: serving on http://{host}:{server.server_address[1]} node={args.node_name}")
    stop.wait()
    server.shutdown()
    return 0
