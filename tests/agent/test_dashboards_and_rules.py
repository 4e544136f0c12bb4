"""charts/dlo/dashboards and charts/dlo/rules against a real Prometheus scraping real processes.

A running `dlo serve` (tiny Wan model, 2 CPU ranks, allgather, one image request) and a running
`dlo agent` (fixture /proc and cgroup-v2 trees so pod series exist; the tiny model under its models
root, evicted first so its --warm runs) are scraped by Debian's Prometheus every second, with the
target labels the chart's PodMonitor and ServiceMonitor give them (job, namespace, pod, deployment,
node; honor_labels for the agent). A third target serves a fixture in dcgm-exporter's exposition
shape (no GPU here), so the GPU panels' label matchers are checked too, and a fourth, as a second
dlo-engine target, the engine series agreed with the serving side that this engine does not serve
yet (`fixtures/engine-metrics`: the method label, requests running, video-job metrics). Then every dashboard query
must parse and return at least one series (with every variable on "All", and with the variables
resolved from Prometheus one after the other, as Grafana chains them), every series an alert
references must exist, and Prometheus must evaluate every rule without error. `promtool check rules`
and `promtool test rules` cover the rule files themselves.
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
# Grafana variables, as a user who picked "All" sees them (every variable's allValue is ".*")
CHAIN = ("namespace", "deployment", "pod", "node")  # the dashboards' variables, each filtered by the ones before
VARIABLES = {"$__rate_interval": "30s", **{f"${v}": ".*" for v in CHAIN}}
# The labels the chart's monitors give the targets (charts/dlo/templates/monitoring.yaml)
ENGINE_TARGET_LABELS = {"namespace": "serving", "deployment": "tiny-wan", "pod": "tiny-wan-0", "node": "node-a"}
AGENT_TARGET_LABELS = {"node": "node-a"}
RUNBOOKS = ROOT / "docs" / "runbooks.md"
RUNBOOK_BASE = "https://github.com/dlo-dev/dlo/blob/main/docs/runbooks.md#"
# Label values that only appear when something goes wrong: the selector is checked without them
# (the metric must exist and carry the label); the promtool unit tests cover the expressions.
ONLY_ON_ERRORS = {
    'code="429"': "no request is turned away (queue full) in a healthy run",
    'code="503"': "no generation request is refused (not ready, rank fault) in a healthy run",
    'code=~"5.."': "no request fails on the server side in a healthy run",
}


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


def substitute(expr: str, values: dict[str, str]) -> str:
    for var, value in sorted(values.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(var, value)
    return expr


def raw_queries() -> list[tuple[str, str, str]]:
    out = []
    for path in DASHBOARDS:
        doc = json.loads(path.read_text())
        for panel in doc["panels"]:
            for target in panel["targets"]:
                out.append((path.name, panel["title"], target["expr"]))
    return out


def dashboard_queries() -> list[tuple[str, str, str]]:
    return [(d, t, substitute(e, VARIABLES)) for d, t, e in raw_queries()]


def all_alerts() -> list[dict]:
    return [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"]]


def alert_selectors() -> list[tuple[str, str]]:
    """(alert, selector) for every `dlo_*` vector selector in every alert expression."""
    out = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                for m in re.finditer(r"\b(dlo_[a-z_]+)(\{[^}]*\})?", rule["expr"]):
                    out.append((rule["alert"], m.group(0)))
    return out


ENGINE_METRIC = re.compile(r"\bdlo_(?!pod_|node_|model_|warm_)\w+")
POD_METRIC = re.compile(r"\b(dlo_pod_[a-z_]+|DCGM_FI_[A-Z_]+)")


def test_dashboard_variables_are_chained_from_the_monitor_labels_and_never_from_up() -> None:
    for path in DASHBOARDS:
        variables = {v["name"]: v for v in json.loads(path.read_text())["templating"]["list"]}
        assert list(variables) == ["datasource", *CHAIN], path.name
        for i, name in enumerate(CHAIN):
            query = variables[name]["query"]["query"]
            assert query.startswith('label_values(dlo_ready{job="dlo-engine"') and query.endswith(f", {name})")
            assert "up{" not in query and "(up," not in query
            for before in CHAIN[:i]:  # chained: filtered by every variable before it
                assert f'{before}=~"${before}"' in query, (path.name, name)
            for after in CHAIN[i:]:
                assert f"${after}" not in query, (path.name, name)
            assert variables[name]["multi"] and variables[name]["includeAll"] and variables[name]["allValue"] == ".*"


@pytest.mark.parametrize("dashboard, panel, expr", raw_queries(), ids=lambda v: v if len(v) < 40 else None)
def test_every_panel_query_uses_the_variables(dashboard: str, panel: str, expr: str) -> None:
    if POD_METRIC.search(expr):  # per pod (agent's dlo_pod_*, dcgm-exporter's GPUs): namespace and pod
        needed = ["namespace", "pod"] + (["node"] if "dlo_pod_" in expr else [])
    elif ENGINE_METRIC.search(expr):  # the engine's own series: the whole chain
        needed = list(CHAIN)
    else:  # the agent's node series
        needed = ["node"]
    selectors = re.findall(r"\b(?:dlo_|DCGM_)\w+(\{[^}]*\})?", expr)
    assert selectors and all(selectors), (dashboard, panel, "a series selected without the variables")
    for selector in selectors:
        for var in needed:
            assert f'{var}=~"${var}"' in selector, (dashboard, panel, selector, var)


def unit_of(expr: str) -> str:
    """The unit a query's values are in, from the metric names (base units, docs/contracts.md section 5)."""
    if "DCGM_FI_DEV_FB_" in expr:
        return "bytes" if "* 1048576" in expr else "MiB"
    if "DCGM_FI_DEV_GPU_UTIL" in expr:
        return "percent"
    if "histogram_quantile" in expr and "_seconds_bucket" in expr:
        return "s"
    if re.search(r"rate\(\w+_seconds_total", expr):
        return "percentunit"  # seconds per second
    if re.search(r"rate\(\w+_bytes_total", expr):
        return "Bps"
    if "rate(dlo_requests_total" in expr:
        return "reqps"
    if "_ratio" in expr:
        return "percentunit"
    if re.search(r"dlo_\w+_bytes\b", expr):
        return "bytes"
    if re.search(r"dlo_\w+_seconds\b", expr):
        return "s"
    if re.search(r"_info\b|dlo_ready\b", expr):
        return "none"
    return "short"  # counts: queue depth, requests per wave, warm runs


def test_no_panel_mixes_units() -> None:
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            units = {unit_of(t["expr"]) for t in panel["targets"]}
            assert units == {panel["fieldConfig"]["defaults"]["unit"]}, (path.name, panel["title"], units)
            assert not any(o.get("properties") for o in panel["fieldConfig"].get("overrides", [])), panel["title"]


def test_gpu_panels_sit_next_to_the_memory_panels() -> None:
    for name in ("dlo-engine.json", "dlo-node-memory.json"):
        panels = json.loads((ROOT / "charts/dlo/dashboards" / name).read_text())["panels"]
        gpu = [p for p in panels if "DCGM_FI_DEV_FB_USED" in " ".join(t["expr"] for t in p["targets"])]
        assert gpu, name
        memory = [p for p in panels if p["fieldConfig"]["defaults"]["unit"] == "bytes" and p not in gpu]
        # on a row with a memory panel (same y), or directly below one
        for g in gpu:
            y = g["gridPos"]["y"]
            assert any(m["gridPos"]["y"] in (y, y - m["gridPos"]["h"]) for m in memory), (name, g["title"])
        assert any("DCGM_FI_DEV_GPU_UTIL" in t["expr"] for p in panels for t in p["targets"]), name


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
    assert {rule["alert"] for rule in all_alerts()} == tested


def test_every_alert_links_its_runbook_section() -> None:
    anchors = {re.sub(r"[^a-z0-9-]", "", h.strip().lower().replace(" ", "-"))
               for h in re.findall(r"^## (.+)$", RUNBOOKS.read_text(), re.M)}
    for rule in all_alerts():
        url = rule["annotations"]["runbook_url"]
        assert url == RUNBOOK_BASE + rule["alert"].lower(), rule["alert"]
        assert url.removeprefix(RUNBOOK_BASE) in anchors, (rule["alert"], "no such section in docs/runbooks.md")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert rule["labels"]["severity"] in ("warning", "critical")


def test_alerts_cover_down_absent_queue_and_error_ratios() -> None:
    exprs = {rule["alert"]: rule["expr"] for rule in all_alerts()}
    assert 'up{job="dlo-engine"} == 0' in exprs["DLOEngineDown"]
    assert 'up{job="dlo-agent"} == 0' in exprs["DLOAgentDown"]
    assert 'up{job="dlo-operator"} == 0' in exprs["DLOOperatorDown"]
    assert exprs["DLOModelBroken"] == "dlo_model_error == 1"
    assert "by (namespace, deployment)" in exprs["DLODeploymentEnginesAbsent"]
    assert "CrashLoopBackOff" in exprs["DLOEngineCrashLooping"]
    assert "dlo_queue_depth" in exprs["DLOQueueDepthHigh"]
    assert 'code="429"' in exprs["DLORequestsRateLimited"] and 'code="503"' in exprs["DLORequestsUnavailable"]
    # ratios of generations: GET polls of video jobs are left out by the method label
    for name in ("DLORequestsRateLimited", "DLORequestsUnavailable", "DLORequestErrorsHigh"):
        assert exprs[name].count('method="POST"') == 2, name
    assert 'code=~"5.."' in exprs["DLORequestErrorsHigh"]
    assert "histogram_quantile(0.95" in exprs["DLORequestLatencyHigh"]


def test_engine_dashboard_has_the_request_and_video_job_panels() -> None:
    exprs = " ".join(t["expr"] for p in json.loads((ROOT / "charts/dlo/dashboards/dlo-engine.json").read_text())["panels"]
                     for t in p["targets"])
    for series in ("dlo_requests_running", "dlo_video_jobs", "dlo_video_job_duration_seconds_bucket",
                   "dlo_video_job_failures_total", "method, code"):
        assert series in exprs, series


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
        engine_port, agent_port, prom_port, dcgm_port = free_port(), free_port(), free_port(), free_port()
        next_port = free_port()
        engine = start(sys.executable, "-m", "dlo.cli.main", "serve", str(models / "tiny-wan"), "--dp", "2",
                       "--mode", "allgather", "--device", "cpu", "--port", str(engine_port),
                       "--host", "127.0.0.1", "--small-limits", log="engine.log")
        agent = start(sys.executable, "-m", "dlo.cli.main", "agent", "--host", "127.0.0.1",
                      "--port", str(agent_port), "--kubernetes", "off", "--models-root", str(models),
                      "--proc-root", str(FIXTURES / "v2/proc"), "--cgroup-root", str(FIXTURES / "v2/cgroup"),
                      "--engine-url", f"http://127.0.0.1:{engine_port}", "--warm", "--warm-interval", "3600",
                      log="agent.log")
        dcgm = start(sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory",
                     str(FIXTURES / "dcgm-exporter"), str(dcgm_port), log="dcgm.log")
        upcoming = start(sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--directory",
                         str(FIXTURES / "engine-metrics"), str(next_port), log="engine-metrics.log")
        wait_for(f"http://127.0.0.1:{next_port}/metrics", 30, upcoming)
        wait_for(f"http://127.0.0.1:{agent_port}/health", 30, agent)
        wait_for(f"http://127.0.0.1:{dcgm_port}/metrics", 30, dcgm)
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
                {"job_name": "dlo-engine", "static_configs": [
                    {"targets": [f"127.0.0.1:{engine_port}", f"127.0.0.1:{next_port}"],
                     "labels": ENGINE_TARGET_LABELS}]},
                {"job_name": "dlo-agent", "honor_labels": True, "static_configs": [
                    {"targets": [f"127.0.0.1:{agent_port}"], "labels": AGENT_TARGET_LABELS}]},
                {"job_name": "dcgm-exporter", "honor_labels": True, "static_configs": [
                    {"targets": [f"127.0.0.1:{dcgm_port}"]}]},
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
            if up and float(up[0]["value"][1]) == 4 and query(base, "count(count_over_time(up[30s]) >= 4) == 4"):
                break
            time.sleep(0.5)
        else:
            log = (tmp / "prometheus.log").read_text()[-2000:]
            raise AssertionError(f"Prometheus did not scrape the four targets: {log}")
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


def chained_variables(base: str) -> dict[str, str]:
    """Each variable's values resolved from Prometheus in order, every one selected (multi-value)."""
    doc = json.loads(DASHBOARDS[0].read_text())
    variables = {v["name"]: v["query"]["query"] for v in doc["templating"]["list"] if v["name"] in CHAIN}
    values = {"$__rate_interval": "30s"}
    for name in CHAIN:
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", variables[name])
        assert m, variables[name]
        selector = substitute(m.group(1), values)
        url = f"{base}/api/v1/label/{m.group(2)}/values?" + urllib.parse.urlencode({"match[]": selector})
        found = json.loads(http_get(url))["data"]
        assert found, f"variable {name}: no values for {selector}"
        values[f"${name}"] = "|".join(promql_regex(v) for v in found)
    return values


def promql_regex(value: str) -> str:
    """A label value as a regex inside a PromQL string literal (backslashes doubled, as Grafana does)."""
    return re.escape(value).replace("\\", "\\\\")


@pytest.mark.slow
def test_chained_variables_resolve_to_the_monitor_labels(stack: str) -> None:
    values = chained_variables(stack)
    assert {k: v for k, v in values.items() if k != "$__rate_interval"} == {
        f"${k}": promql_regex(v) for k, v in ENGINE_TARGET_LABELS.items()}


@pytest.mark.slow
def test_dashboard_queries_return_series_for_a_chained_selection(stack: str) -> None:
    values = chained_variables(stack)
    missing = []
    for dashboard, panel, expr in raw_queries():
        if "dlo_pod_" in expr:
            # Outside Kubernetes the agent names a pod by its cgroup uid or engine URL (no pod API to
            # ask), so these cannot match the engine's pod name here; with "All" they are checked above.
            continue
        if not query(stack, substitute(expr, values)):
            missing.append((dashboard, panel, expr))
    assert not missing, missing


@pytest.mark.slow
@pytest.mark.parametrize("alert, selector", alert_selectors())
def test_alert_series_exist(stack: str, alert: str, selector: str) -> None:
    stripped = selector
    for matcher in ONLY_ON_ERRORS:
        stripped = re.sub(r",?\s*" + re.escape(matcher), "", stripped)
    series = query(stack, stripped)
    assert series, f"{alert}: no series {stripped}"
    for matcher in ONLY_ON_ERRORS:
        if matcher in selector:
            label = matcher.split("=")[0]
            assert all(label in s["metric"] for s in series), f"{alert}: {stripped} has no label {label}"


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
    assert {r["name"] for r in rules} == {rule["alert"] for rule in all_alerts()}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
