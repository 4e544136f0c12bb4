"""What the operator costs on a fleet, on the API emulator: 1,000 nodes whose kubelets post a
heartbeat every 10 s, 50 DLODeployments of 20 engine pods (1,000 pods, Running and Ready), and a
real `dlo operator run` process; for one minute, count the operator's API calls (its own client's
and kopf's, by method), its reconciles, and its CPU seconds.

    python -m bench operator-fleet [--seconds 60] [--operator-src DIR] [--out FILE]

Ten pools of 100 nodes (label `dlo.dev/pool`), five DLODeployments a pool (`placement.nodeSelector`),
each node an H200 node profile. During the window every node's Ready condition gets a new
`lastHeartbeatTime` every 10 s (100 node events a second, none of them a change the operator acts
on), and every 5 s one node's profile changes its page-cache residency (a change the five
DLODeployments of its pool report). `--operator-src DIR`: run the operator package from DIR (another
checkout's operator/ folder, e.g. a git worktree of an earlier commit), the rest of dlo from here:
the before-and-after of a change to the operator.
Must never: talk to a real cluster (the emulator only), or sleep for a state: it waits for one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import yaml

from bench.lib.provenance import provenance
from tests.operator.cluster import declare_resources
from tests.operator.emulator import Emulator, now

ROOT = Path(__file__).resolve().parents[1]

NODES, POOLS, DEPLOYMENTS, REPLICAS = 1000, 10, 50, 20
HEARTBEAT_S, PROFILE_CHANGE_S = 10.0, 5.0
NS = "serving"
PROFILE = json.loads((ROOT / "examples" / "profiles" / "h200-node.json").read_text())
LAUNCH = """
import sys
src = sys.argv[1]
if src:
    import __editable___dlo_0_1_0_finder as finder  # the editable install's map of dlo's folders
    finder.MAPPING["dlo.operator"] = src
    finder.NAMESPACES["dlo.operator"] = [src]  # operator/ has no __init__.py: a namespace package
import dlo.operator.handlers
print("operator from", dlo.operator.handlers.__file__, file=sys.stderr)
from dlo.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


class FleetEmulator(Emulator):
    """The tests' emulator, with a request log of bounded length (kmock matches every request against
    the whole log: quadratic over a minute of a fleet) and its own count of the operator's calls."""

    KEEP = 64  # well above the requests in flight at once: each must still find itself in the log

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.calls: Counter = Counter()

    async def _handle(self, request):  # type: ignore[override]
        if request.headers.get("User-Agent", "").startswith(("dlo-operator", "kopf/")):
            self.calls[f"{request.method.value} {request.resource.plural if request.resource else '-'}"] += 1
        del self._requests[:-self.KEEP]
        return await super()._handle(request)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node(i: int) -> dict[str, Any]:
    name = f"node-{i:04d}"
    profile = {**PROFILE, "node": name}
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": now(),
             "lastTransitionTime": "2026-01-01T00:00:00Z"}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "dlo.dev/pool": f"pool-{i % POOLS}"},
                         "annotations": {"dlo.dev/node-profile": json.dumps(profile)}},
            "status": {"allocatable": {"cpu": "64", "nvidia.com/gpu": "8"}, "conditions": [ready]}}


def deployment(j: int) -> dict[str, Any]:
    spec = {"model": {"path": "/models/wan2.1-14b"}, "replicas": REPLICAS, "devicesPerNode": 8,
            "placement": {"nodeSelector": {"dlo.dev/pool": f"pool-{j % POOLS}"}}}
    return {"apiVersion": "dlo.dev/v1alpha1", "kind": "DLODeployment",
            "metadata": {"name": f"dlod-{j:02d}", "namespace": NS}, "spec": spec}


async def post(emulator: FleetEmulator, path: str, body: dict[str, Any]) -> None:
    async with emulator.request("POST", path, json=body) as resp:
        assert resp.status < 300, await resp.text()


async def patch(emulator: Emulator, path: str, body: dict[str, Any]) -> None:
    headers = {"Content-Type": "application/merge-patch+json"}
    async with emulator.request("PATCH", path, json=body, headers=headers) as resp:
        assert resp.status < 300, await resp.text()


def live(emulator: Emulator, plural: str) -> list[dict[str, Any]]:
    return [o.raw for (res, _, _), o in emulator.objects.items() if res.plural == plural and not o.deleted]


async def make_pods(emulator: Emulator, made: set[str]) -> None:
    """What the StatefulSet controller and the scheduler would do, once per StatefulSet: its pods,
    Running and Ready, each on a node of its pool (deployment j of a pool: the pool's nodes 20j..)."""
    for sts in live(emulator, "statefulsets"):
        name = sts["metadata"]["name"]
        if name in made:
            continue
        made.add(name)
        j = int(name.rsplit("-", 1)[1])
        pool = [i for i in range(NODES) if i % POOLS == j % POOLS]
        template = sts["spec"]["template"]
        for r in range(REPLICAS):
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
                "name": f"{name}-{r}", "namespace": NS, "labels": template["metadata"]["labels"],
                "annotations": template["metadata"]["annotations"],
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name,
                                     "uid": sts["metadata"]["uid"], "controller": True}]},
                "spec": {**template["spec"], "nodeName": f"node-{pool[(j // POOLS) * REPLICAS + r]:04d}"},
                "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
            await post(emulator, f"/api/v1/namespaces/{NS}/pods", pod)


async def heartbeats(emulator: Emulator, seconds: float, counts: Counter) -> None:
    """Every node's Ready condition re-posted every HEARTBEAT_S (spread evenly), and one node's
    page-cache residency changed every PROFILE_CHANGE_S."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    step = HEARTBEAT_S / NODES
    i = 0
    next_profile = start
    while loop.time() - start < seconds:
        due = start + i * step
        if loop.time() < due:
            await asyncio.sleep(due - loop.time())
        n = i % NODES
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "lastHeartbeatTime": now(),
                 "lastTransitionTime": "2026-01-01T00:00:00Z"}
        await patch(emulator, f"/api/v1/nodes/node-{n:04d}", {"status": {"conditions": [ready]}})
        counts["heartbeats"] += 1
        if loop.time() >= next_profile:
            k = counts["profile_changes"]
            changed = {**PROFILE, "node": f"node-{k % NODES:04d}"}
            for entry in changed.get("models", {}).values():
                entry["resident_ratio"] = round(0.5 + (k % 50) / 100, 3)
            await patch(emulator, f"/api/v1/nodes/node-{k % NODES:04d}",
                        {"metadata": {"annotations": {"dlo.dev/node-profile": json.dumps(changed)}}})
            counts["profile_changes"] += 1
            next_profile += PROFILE_CHANGE_S
        i += 1


def rss_mib(pid: int) -> float:
    kib = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return round(int(kib.group(1)) / 1024, 1) if kib else float("nan")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def reconciles(port: int) -> float:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
            text = await resp.text()
    return sum(float(v) for v in re.findall(r"^dlo_operator_reconciles_total\{[^}]*\} (\S+)$", text, re.M))


async def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.5)


def all_ready(emulator: Emulator) -> bool:
    done = [d for d in live(emulator, "dlodeployments") if (d.get("status") or {}).get("readyReplicas") == REPLICAS]
    return len(done) == DEPLOYMENTS


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    emulator = FleetEmulator()
    declare_resources(emulator)
    async with emulator, kmock.Server(emulator):
        for i in range(NODES):
            await post(emulator, "/api/v1/nodes", node(i))
        for j in range(DEPLOYMENTS):
            await post(emulator, f"/apis/dlo.dev/v1alpha1/namespaces/{NS}/dlodeployments", deployment(j))
        tmp = Path(tempfile.mkdtemp(prefix="operator-fleet-"))
        kubeconfig = tmp / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": str(emulator.url).rstrip("/")}}],
            "users": [{"name": "bench", "user": {"token": "bench"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "bench"}}]}))
        metrics_port = free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", LAUNCH, args.operator_src, "operator", "run", "--status-interval",
            str(args.status_interval), "--metrics-port", str(metrics_port), "--liveness", "",
            env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=asyncio.subprocess.DEVNULL,
            stderr=(tmp / "operator.log").open("wb"))
        try:
            made: set[str] = set()
            loop = asyncio.get_running_loop()
            started = loop.time()
            while not all_ready(emulator):
                if loop.time() - started > args.settle_timeout:
                    raise SystemExit(f"not every DLODeployment ready after {args.settle_timeout:.0f} s")
                await make_pods(emulator, made)
                await asyncio.sleep(0.5)
            settled = loop.time() - started
            await asyncio.sleep(args.quiet)  # the creation's last rounds end before the window opens
            counts: Counter = Counter()
            before, cpu0, rec0 = Counter(emulator.calls), cpu_seconds(proc.pid), await reconciles(metrics_port)
            t0 = time.monotonic()
            await heartbeats(emulator, args.seconds, counts)
            window = time.monotonic() - t0
            cpu1, rec1, rss = cpu_seconds(proc.pid), await reconciles(metrics_port), rss_mib(proc.pid)
            calls = emulator.calls - before
        finally:
            proc.terminate()
            await proc.wait()
    return {"operator_src": args.operator_src or "(this checkout)", "nodes": NODES, "dlodeployments": DEPLOYMENTS,
            "pods": DEPLOYMENTS * REPLICAS, "status_interval_s": args.status_interval,
            "seconds_to_all_ready": round(settled, 1), "window_s": round(window, 1),
            "node_heartbeats": counts["heartbeats"], "profile_changes": counts["profile_changes"],
            "reconciles": rec1 - rec0, "operator_cpu_s": round(cpu1 - cpu0, 2), "operator_rss_mib": rss,
            "api_calls": sum(calls.values()), "api_calls_by_kind": dict(sorted(calls.items()))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench operator-fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="the measured window")
    parser.add_argument("--status-interval", type=float, default=15.0, help="the operator's resync (its default)")
    parser.add_argument("--operator-src", default="", help="the operator/ folder to run (default: this checkout's)")
    parser.add_argument("--settle-timeout", type=float, default=600.0)
    parser.add_argument("--quiet", type=float, default=20.0, help="seconds between all ready and the window")
    parser.add_argument("--out", type=Path, default=None, help="append the result (JSON) to this file")
    args = parser.parse_args(argv)
    result = {**asyncio.run(bench(args)), "provenance": provenance("cpu")}
    line = json.dumps(result)
    print(line)
    if args.out:
        with args.out.open("a") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
