"""charts/dlo/dashboards and charts/dlo/rules against a real Prometheus scraping real processes.

A running `dlo serve` (tiny Wan model, 2 CPU ranks, allgather, one image request) and a running
`dlo agent` (fixture /proc and cgroup-v2 trees so pod series exist; the tiny model under its models
root, evicted first so its --warm runs) are scraped by Debian's Prometheus every second. Then every
dashboard query must parse and return at least one series, every series an alert references must
exist, and Prometheus must evaluate every rule without error. `promtool check rules` and
`promtool test rules` cover the rule files themselves.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "charts/dlo/dashboards").glob("*.json"))
RULE_FILES = sorted((ROOT / "charts/dlo/rules").glob("*.yaml"))
RULE_TESTS = sorted((ROOT / "charts/dlo/rules/tests").glob("*.yaml"))
FIXTURES = Path(__file__).parent / "fixtures"
# Grafana variables, as a user who picked "All" sees them
VARIABLES = {"$__rate_interval": "30s", "$instance": ".*"}


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is missing: `make test` installs Debian's prometheus package"
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def wait_for(url: str, deadline_s: float, proc: subprocess.Popen | None = None) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode} before {url} answered")
        try:
            http_get(url, timeout=1)
            return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"{url} did not answer within {deadline_s} s")


def dashboard_queries() -> list[tuple[str, str, str]]:
    out = []
    for path in DASHBOARDS:
        doc = json.loads(path.read_text())
        for panel in doc["panels"]:
            for target in panel["targets"]:
                expr = target["expr"]
                for var, value in VARIABLES.items():
                    expr = expr.replace(var, value)
                out.append((path.name, panel["title"], expr))
    return out


def alert_selectors() -> list[tuple[str, str]]:
    """(alert, selector) for every `dlo_*` vector selector in every alert expression."""
    out = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                for m in re.finditer(r"\b(dlo_[a-z_]+)(\{[^}]*\})?", rule["expr"]):
                    out.append((rule["alert"], m.group(0)))
    return out


def test_every_dashboard_is_valid_grafana_json_with_unique_ids() -> None:
    assert {p.name for p in DASHBOARDS} == {"dlo-node-memory.json", "dlo-engine.json", "dlo-mode-topology.json"}
    uids = set()
    for path in DASHBOARDS:
        doc = json.loads(path.read_text())
        assert doc["uid"] not in uids
        uids.add(doc["uid"])
        ids = [p["id"] for p in doc["panels"]]
        assert len(ids) == len(set(ids)), path.name
        for p in doc["panels"]:
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], (path.name, p["title"])


def test_promtool_check_rules_is_clean() -> None:
    r = subprocess.run([tool("promtool"), "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_promtool_rule_unit_tests_pass() -> None:
    assert RULE_TESTS
    r = subprocess.run([tool("promtool"), "test", "rules", *map(str, RULE_TESTS)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_alert_has_a_unit_test() -> None:
    tested = set()
    for path in RULE_TESTS:
        for t in yaml.safe_load(path.read_text())["tests"]:
            for a in t.get("alert_rule_test", []):
                if a.get("exp_alerts"):
                    tested.add(a["alertname"])
    assert {alert for alert, _ in alert_selectors()} == tested


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Engine + agent + Prometheus; yields the Prometheus base URL once both targets were scraped."""
    tmp = tmp_path_factory.mktemp("prom")
    models = tmp / "models"
    procs: list[subprocess.Popen] = []
    env = dict(os.environ, DLO_LOG_LEVEL="WARNING")

    def start(*args: str, log: str) -> subprocess.Popen:
        p = subprocess.Popen(
            [*args], cwd=ROOT, env=env, stdout=open(tmp / log, "w"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(p)
        return p

    try:
        subprocess.run(
            [sys.executable, "-m", "dlo.cli.main", "make-tiny-model", str(models / "tiny-wan"), "--family", "wan"],
            cwd=ROOT, check=True, capture_output=True, env=env,
        )
        for f in models.rglob("*.safetensors"):  # cold, so the agent's --warm has work to do
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        engine_port, agent_port, prom_port = free_port(), free_port(), free_port()
        engine = start(sys.executable, "-m", "dlo.cli.main", "serve", str(models / "tiny-wan"), "--dp", "2",
                       "--mode", "allgather", "--device", "cpu", "--port", str(engine_port),
                       "--host", "127.0.0.1", "--small-limits", log="engine.log")
        agent = start(sys.executable, "-m", "dlo.cli.main", "agent", "--host", "127.0.0.1",
                      "--port", str(agent_port), "--kubernetes", "off", "--models-root", str(models),
                      "--proc-root", str(FIXTURES / "v2/proc"), "--cgroup-root", str(FIXTURES / "v2/cgroup"),
                      "--engine-url", f"http://127.0.0.1:{engine_port}", "--warm", "--warm-interval", "3600",
                      log="agent.log")
        wait_for(f"http://127.0.0.1:{agent_port}/health", 30, agent)
        wait_for(f"http://127.0.0.1:{engine_port}/ready", 120, engine)
        req = urllib.request.Request(
            f"http://127.0.0.1:{engine_port}/v1/images/generations",
            data=json.dumps({"prompt": "a lighthouse", "num_inference_steps": 2}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(f) for f in RULE_FILES],
            "scrape_configs": [
                {"job_name": "dlo-engine", "static_configs": [{"targets": [f"127.0.0.1:{engine_port}"]}]},
                {"job_name": "dlo-agent", "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"]}]},
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom = start(tool("prometheus"), f"--config.file={tmp / 'prometheus.yml'}",
                     f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
                     log="prometheus.log")
        base = f"http://127.0.0.1:{prom_port}"
        wait_for(base + "/-/ready", 30, prom)
        # a few scrapes of both targets, so rate() has two samples in its window
        end = time.monotonic() + 30
        while time.monotonic() < end:
            up = query(base, "sum(up)")
            if up and float(up[0]["value"][1]) == 2 and query(base, "count(count_over_time(up[30s]) >= 4)"):
                break
            time.sleep(0.5)
        else:
            log = (tmp / "prometheus.log").read_text()[-2000:]
            raise AssertionError(f"Prometheus did not scrape both targets: {log}")
        yield base
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def query(base: str, expr: str) -> list[dict]:
    url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        doc = json.loads(http_get(url))
    except urllib.error.HTTPError as e:
        raise AssertionError(f"query {expr!r} failed: {e.read().decode()}") from e
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


@pytest.mark.slow
@pytest.mark.parametrize("dashboard, panel, expr", dashboard_queries(), ids=lambda v: v if len(v) < 40 else None)
def test_dashboard_query_returns_series(stack: str, dashboard: str, panel: str, expr: str) -> None:
    assert query(stack, expr), f"{dashboard} / {panel}: no series for {expr}"


@pytest.mark.slow
@pytest.mark.parametrize("alert, selector", alert_selectors())
def test_alert_series_exist(stack: str, alert: str, selector: str) -> None:
    assert query(stack, selector), f"{alert}: no series {selector}"


@pytest.mark.slow
def test_prometheus_evaluates_every_rule_without_error(stack: str) -> None:
    end = time.monotonic() + 10
    while True:
        groups = json.loads(http_get(stack + "/api/v1/rules"))["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(r.get("lastEvaluation", "").startswith("2") and not r["lastEvaluation"].startswith("0001")
                         for r in rules) or time.monotonic() > end:
            break
        time.sleep(0.5)
    assert {r["name"] for r in rules} == {a for a, _ in alert_selectors()}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
