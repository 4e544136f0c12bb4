"""`dlo operator run` (operator/cli.py, operator/reconcile.py) against kmock's API emulator with JSON logs and
the standard OTEL_* variables pointing at a real OTLP/HTTP receiver: every line on stderr is one JSON
object (kopf's own records among them, naming their resource), the fetch Jobs it creates log JSON too,
and every reconcile is a span."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from cluster import dlodeployment, running_cluster
from test_cli import free_port, kubeconfig_for
from tests.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _fetch_command(cluster) -> list[str] | None:
    for job in cluster.objects("Job", "serving"):
        for container in job["spec"]["template"]["spec"]["containers"]:
            if container["command"][:2] == ["dlo", "fetch"]:
                return container["command"]
    return None


async def test_the_operator_logs_json_lines_and_traces_each_reconcile(tmp_path):
    log_path = tmp_path / "operator.log"
    with OtlpReceiver() as otlp:
        async with running_cluster(with_operator=False) as cluster:
            env = {**os.environ, "KUBECONFIG": str(kubeconfig_for(cluster, tmp_path)), **otlp.env()}
            with log_path.open("wb") as log:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "dlo.cli.main", "operator", "run", "--status-interval", "1",
                    "--log-format", "json", "--liveness", "", "--metrics-port", str(free_port()),
                    cwd=ROOT, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=log)
            try:
                await cluster.add_node("node-0", allocatable={"nvidia.com/gpu": "1"})
                await cluster.create(dlodeployment("tiny", "serving", {"model": {"path": "/models/tiny"}}))
                await cluster.wait(lambda: cluster.get("StatefulSet", "serving", "tiny"), timeout=30,
                                   what="the StatefulSet")
                await cluster.wait(lambda: any(s.attributes.get("dlo.reconcile.result") == "success"
                                               for s in otlp.spans("dlo.reconcile")), timeout=30,
                                   what="a successful reconcile's span")
                await cluster.create(dlodeployment("fetched", "serving", {"model": {"uri": "s3://models/wan"}}))
                fetch = await cluster.wait(lambda: _fetch_command(cluster), timeout=30, what="a fetch Job")
                assert fetch[fetch.index("--log-format") + 1] == "json"  # fetch Jobs log as the operator does
            finally:
                proc.terminate()
                assert await asyncio.wait_for(proc.wait(), timeout=30) == 0
    span = next(s for s in otlp.spans("dlo.reconcile") if s.attributes.get("dlo.reconcile.result") == "success")
    assert (span.service, span.parent_id, span.status) == ("dlo-operator", "", 0)
    assert (span.attributes["k8s.namespace.name"], span.attributes["dlo.deployment"]) == ("serving", "tiny")

    records = [json.loads(line) for line in log_path.read_text().splitlines()]  # every line is one JSON object
    # kopf's JSON records (kopf.configure), with the `logger` field every dlo process's records have
    assert records and all({"timestamp", "severity", "logger", "message"} <= r.keys() for r in records)
    about = [r for r in records if r.get("object", {}).get("name") == "tiny"]  # kopf's records name the resource
    assert about and all(r["object"]["namespace"] == "serving" for r in about)
