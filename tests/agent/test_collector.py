"""dlo.agent.collector: the agent metrics, their labels, and scrapes that survive failing sources."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from dlo.agent.pods import PodInfo

from .conftest import V2_POD_A, V2_POD_B, make_agent, pods_for, samples


def test_outside_kubernetes_pods_are_labelled_by_uid(models_root: Path) -> None:
    agent = make_agent(models_root)
    from prometheus_client import generate_latest

    from dlo.agent.collector import make_registry

    got = samples(generate_latest(make_registry(agent)).decode())
    pods = {lab["pod"] for lab, _ in got["dlo_pod_cgroup_memory_bytes"]}
    assert V2_POD_A in pods and V2_POD_B in pods
    assert {lab["namespace"] for lab, _ in got["dlo_pod_cgroup_memory_bytes"]} == {""}


def test_promtool_check_metrics_is_clean(models_root: Path, engine_url: str) -> None:
    from prometheus_client import generate_latest

    from dlo.agent.collector import make_registry

    agent = make_agent(models_root, pods_for(engine_url))
    agent.warm_models()
    text = generate_latest(make_registry(agent))
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make test` installs Debian's prometheus package"
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True)
    assert proc.returncode == 0 and proc.stdout.strip() == b"" and proc.stderr.strip() == b"", proc


def test_unreachable_engine_and_pod_listing_failure_do_not_fail_the_scrape(models_root: Path) -> None:
    class Broken:
        def pods(self) -> list[PodInfo]:
            raise ConnectionError("API down")

    agent = make_agent(models_root, Broken(), engine_urls=["http://127.0.0.1:9"])
    from prometheus_client import generate_latest

    from dlo.agent.collector import make_registry

    got = samples(generate_latest(make_registry(agent)).decode())
    assert got["dlo_pod_host_pinned_bytes"] == []
    assert got["dlo_node_memory_bytes"]
