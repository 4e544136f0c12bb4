"""The node agent's exporter: `/metrics`, `/profile`, `/health`, and the node-profile annotation.

Owns: the Prometheus collector for the agent metrics of CONTRACTS.md section 5 (names, labels and
units are a contract), finding this node's engines (Kubernetes pods labelled
`app.kubernetes.io/part-of=dlo,app.kubernetes.io/component=engine`, or `--engine-url`), scraping
their `dlo_host_pinned_bytes`, the HTTP server, publishing the `NodeProfile` as node annotation
`dlo.dev/node-profile`, and the optional background warmer (`--warm`).
Must never: import torch, write anything on the host, patch any node but its own or any annotation
but `dlo.dev/node-profile`, or let one unreadable source fail a scrape (a source that fails is
logged and its series are left out).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from dlo.agent.memory import CGROUP_KINDS, NODE_KINDS, CgroupFS, MemorySnapshot, ProcFS, snapshot
from dlo.agent.profile import ANNOTATION, CalibrationFragment, NodeProfile, apply_calibration
from dlo.agent.topology import (
    Devices,
    ModelFolder,
    build_profile,
    can_register_page_cache,
    detect_devices,
    model_folders,
)
from dlo.agent.warm import warm

log = logging.getLogger(__name__)

PART_OF_DLO = ("app.kubernetes.io/part-of", "dlo")
DEFAULT_ENGINE_PORT = 8000
SCRAPE_TIMEOUT_S = 2.0
# pod cgroup kinds exported (the contract's six, plus the peak where the kernel reports one)
POD_CGROUP_KINDS = ("usage", "peak", "anon", "file", "shmem", "file_mapped", "kernel")
assert set(POD_CGROUP_KINDS) <= set(CGROUP_KINDS)


@dataclass(frozen=True)
class PodInfo:
    uid: str
    namespace: str
    name: str
    ip: str | None
    labels: dict[str, str]
    http_port: int | None

    @property
    def is_dlo(self) -> bool:
        return self.labels.get(PART_OF_DLO[0]) == PART_OF_DLO[1]

    @property
    def is_engine(self) -> bool:
        return self.is_dlo and self.labels.get("app.kubernetes.io/component") == "engine"


@dataclass(frozen=True)
class EngineTarget:
    url: str  # base URL; /metrics is appended
    namespace: str
    pod: str


class PodSource(Protocol):
    def pods(self) -> list[PodInfo]: ...


class KubernetesPods:
    """Pods on this node from the API (list pods with a `spec.nodeName` field selector)."""

    def __init__(self, node_name: str, *, host: str | None = None):
        """In-cluster credentials, else ~/.kube/config; `host` talks to that API URL instead."""
        from kubernetes import client, config

        if host is not None:
            api_client = client.ApiClient(client.Configuration(host=host))
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                try:
                    config.load_kube_config()
                except (config.ConfigException, OSError) as e:
                    raise ValueError(
                        f"no Kubernetes credentials (not in a cluster, no kubeconfig): {e}; "
                        "run with --kubernetes off outside a cluster"
                    ) from e
            api_client = client.ApiClient()
        self.api = client.CoreV1Api(api_client)
        self.node_name = node_name

    def pods(self) -> list[PodInfo]:
        items = self.api.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={self.node_name}").items
        out = []
        for p in items:
            if p.spec.node_name != self.node_name:
                continue  # the field selector already does this on a real API server
            port = None
            for c in p.spec.containers or []:
                for cp in c.ports or []:
                    if cp.name == "http":
                        port = cp.container_port
            out.append(
                PodInfo(
                    uid=p.metadata.uid,
                    namespace=p.metadata.namespace,
                    name=p.metadata.name,
                    ip=p.status.pod_ip,
                    labels=dict(p.metadata.labels or {}),
                    http_port=port,
                )
            )
        return out

    def annotate_node(self, value: str) -> None:
        self.api.patch_node(self.node_name, {"metadata": {"annotations": {ANNOTATION: value}}})


def scrape_pinned(url: str, timeout: float = SCRAPE_TIMEOUT_S) -> dict[str, float]:
    """Sum of an engine's `dlo_host_pinned_bytes` over ranks, by `source`."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "dlo_host_pinned_bytes":
            continue
        for s in family.samples:
            source = s.labels.get("source", "unknown")
            out[source] = out.get(source, 0.0) + s.value
    return out


@dataclass
class WarmRecord:
    seconds: float | None = None
    runs: dict[str, int] = field(default_factory=lambda: {"ok": 0, "below_threshold": 0, "error": 0})


@dataclass
class AgentConfig:
    node_name: str
    models_root: Path | None = None
    proc_root: Path = Path("/proc")
    cgroup_root: Path = Path("/sys/fs/cgroup")
    sys_root: Path = Path("/sys")
    engine_urls: list[str] = field(default_factory=list)
    calibration: Path | None = None
    kubernetes: bool = False
    warm: bool = False
    warm_threshold: float = 0.99
    models_ttl_s: float = 10.0
    pods_ttl_s: float = 15.0


class Agent:
    """State behind the exporter: one scan per scrape, model facts cached for `models_ttl_s`."""

    def __init__(self, cfg: AgentConfig, *, devices: Devices | None = None, pods: PodSource | None = None):
        self.cfg = cfg
        self.proc = ProcFS(cfg.proc_root)
        self.cgroups = CgroupFS(cfg.cgroup_root)
        self.devices = devices if devices is not None else detect_devices(cfg.sys_root)
        self.pod_source = pods
        self.fragment = self._load_calibration(cfg.calibration)
        self.warm_records: dict[str, WarmRecord] = {}
        self._models: tuple[float, list[ModelFolder]] | None = None
        self._pods: tuple[float, list[PodInfo]] | None = None
        self._lock = threading.Lock()

    @staticmethod
    def _load_calibration(path: Path | None) -> CalibrationFragment | None:
        if path is None:
            return None
        try:
            return CalibrationFragment.model_validate_json(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a usable calibration fragment ({e})") from e

    # -- sources ------------------------------------------------------------------------------

    def models(self, fresh: bool = False) -> list[ModelFolder]:
        with self._lock:
            now = time.monotonic()
            if fresh or self._models is None or now - self._models[0] > self.cfg.models_ttl_s:
                self._models = (now, model_folders(self.cfg.models_root))
            return self._models[1]

    def profile(self) -> NodeProfile:
        p = build_profile(
            self.cfg.node_name, self.devices, proc=self.proc, sys_root=self.cfg.sys_root, models=self.models()
        )
        return apply_calibration(p, self.fragment) if self.fragment else p

    def pods(self) -> list[PodInfo]:
        """Pods on this node, listed at most every `pods_ttl_s` (scrapes must not hammer the API)."""
        if self.pod_source is None:
            return []
        now = time.monotonic()
        if self._pods is not None and now - self._pods[0] < self.cfg.pods_ttl_s:
            return self._pods[1]
        try:
            pods = self.pod_source.pods()
        except Exception as e:  # API errors of any kind: the scrape goes on with what it knew
            log.warning("pod listing failed error=%s", e)
            return self._pods[1] if self._pods is not None else []
        self._pods = (now, pods)
        return pods

    def engine_targets(self, pods: list[PodInfo]) -> list[EngineTarget]:
        targets = [EngineTarget(u, "", u) for u in self.cfg.engine_urls]
        for p in pods:
            if p.is_engine and p.ip:
                targets.append(EngineTarget(f"http://{p.ip}:{p.http_port or DEFAULT_ENGINE_PORT}", p.namespace, p.name))
        return targets

    def memory(self) -> MemorySnapshot:
        return snapshot(self.proc, self.cgroups)

    # -- warming ------------------------------------------------------------------------------

    def warm_models(self) -> None:
        """Warm every model folder whose residency is below the threshold; record the outcome."""
        for m in self.models(fresh=True):
            ratio = m.resident_bytes / m.files_bytes if m.files_bytes and m.resident_bytes is not None else 0.0
            if ratio >= self.cfg.warm_threshold:
                continue
            rec = self.warm_records.setdefault(m.name, WarmRecord())
            try:
                s = warm([m.path], threshold=self.cfg.warm_threshold)
                rec.seconds = s.seconds
                rec.runs["ok" if s.ok else "below_threshold"] += 1
            except OSError as e:
                log.warning("warm failed model=%s error=%s", m.name, e)
                rec.runs["error"] += 1
        self.models(fresh=True)


class AgentCollector:
    """Prometheus collector: every agent metric, computed at scrape time."""

    def __init__(self, agent: Agent):
        self.agent = agent

    def describe(self) -> Iterable[Metric]:
        return []  # no scrape at registration time

    def collect(self) -> Iterable[Metric]:
        a = self.agent
        pods = a.pods()
        by_uid = {p.uid: p for p in pods}
        yield from self._memory(a.memory(), by_uid, kubernetes=a.pod_source is not None)
        yield self._pinned(a.engine_targets(pods))
        yield from self._models(a.models())
        yield self._profile_info(a)

    def _memory(self, snap: MemorySnapshot, by_uid: dict[str, PodInfo], kubernetes: bool) -> Iterable[Metric]:
        node = GaugeMetricFamily("dlo_node_memory_bytes", "node memory from /proc/meminfo", labels=["kind"])
        for kind in NODE_KINDS:
            if snap.node.get(kind) is not None:
                node.add_metric([kind], float(snap.node[kind]))  # type: ignore[arg-type]
        yield node
        cg = GaugeMetricFamily(
            "dlo_pod_cgroup_memory_bytes", "memory charged to the pod's cgroup", labels=["namespace", "pod", "kind"]
        )
        pss = GaugeMetricFamily("dlo_pod_pss_bytes", "sum of the pod's processes' PSS", labels=["namespace", "pod"])
        for uid, pm in sorted(snap.pods.items()):
            info = by_uid.get(uid)
            if kubernetes and (info is None or not info.is_dlo):
                continue  # only DLO pods, by name, in a cluster
            ns, name = (info.namespace, info.name) if info else ("", uid)
            if pm.cgroup is not None:
                for kind in POD_CGROUP_KINDS:
                    v = pm.cgroup.get(kind)
                    if v is not None:
                        cg.add_metric([ns, name, kind], float(v))
            if pm.pss is not None:
                pss.add_metric([ns, name], float(pm.pss))
        yield cg
        yield pss
        inv = GaugeMetricFamily(
            "dlo_node_cgroup_invisible_bytes",
            "estimate: node used memory (MemTotal - MemFree) minus what the cgroup hierarchy accounts for",
        )
        if snap.cgroup_invisible_bytes is not None:
            inv.add_metric([], float(snap.cgroup_invisible_bytes))
        yield inv

    def _pinned(self, targets: list[EngineTarget]) -> Metric:
        fam = GaugeMetricFamily(
            "dlo_pod_host_pinned_bytes",
            "host memory the pod's engine made DMA-able (scraped from dlo_host_pinned_bytes)",
            labels=["namespace", "pod", "source"],
        )
        for t in targets:
            try:
                pinned = scrape_pinned(t.url)
            except (OSError, ValueError, urllib.error.URLError) as e:
                log.warning("engine scrape failed url=%s error=%s", t.url, e)
                continue
            for source, value in sorted(pinned.items()):
                fam.add_metric([t.namespace, t.pod, source], value)
        return fam

    def _models(self, models: list[ModelFolder]) -> Iterable[Metric]:
        size = GaugeMetricFamily("dlo_model_bytes", "safetensors bytes of a model folder", labels=["model"])
        res = GaugeMetricFamily(
            "dlo_model_page_cache_resident_bytes", "bytes of the model's files in the page cache", labels=["model"]
        )
        ratio = GaugeMetricFamily(
            "dlo_model_page_cache_resident_ratio", "page-cache residency of the model's files, 0..1", labels=["model"]
        )
        for m in models:
            size.add_metric([m.name], float(m.files_bytes))
            if m.resident_bytes is not None:
                res.add_metric([m.name], float(m.resident_bytes))
                ratio.add_metric([m.name], m.resident_bytes / m.files_bytes if m.files_bytes else 1.0)
        yield from (size, res, ratio)
        dur = GaugeMetricFamily("dlo_warm_duration_seconds", "duration of the last warm", labels=["model"])
        runs = CounterMetricFamily("dlo_warm_runs", "warms run by this agent", labels=["model", "result"])
        for name, rec in sorted(self.agent.warm_records.items()):
            if rec.seconds is not None:
                dur.add_metric([name], rec.seconds)
            for result, n in rec.runs.items():
                runs.add_metric([name, result], float(n))
        yield from (dur, runs)

    def _profile_info(self, a: Agent) -> Metric:
        acc = a.devices.accelerator
        fam = GaugeMetricFamily(
            "dlo_node_profile_info",
            "node topology",
            labels=["accelerator", "count", "interconnect", "can_register_page_cache"],
        )
        fam.add_metric(
            [acc.model or acc.vendor, str(acc.count), a.devices.interconnect_kind,
             str(can_register_page_cache(acc.vendor)).lower()],
            1.0,
        )
        return fam


def make_registry(agent: Agent) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(AgentCollector(agent))  # type: ignore[arg-type]
    return reg


def make_handler(agent: Agent, registry: CollectorRegistry) -> type[BaseHTTPRequestHandler]:
    routes: dict[str, Callable[[], tuple[int, str, bytes]]] = {
        "/metrics": lambda: (200, "text/plain; version=0.0.4; charset=utf-8", generate_latest(registry)),
        "/profile": lambda: (
            200, "application/json", agent.profile().model_dump_json(indent=1, exclude_none=True).encode()
        ),
        "/health": lambda: (200, "text/plain", b"ok\n"),
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            route = routes.get(self.path.split("?", 1)[0])
            if route is None:
                code, ctype, body = 404, "application/json", json.dumps({"error": f"no route {self.path}"}).encode()
            else:
                try:
                    code, ctype, body = route()
                except Exception as e:  # one failing source must not take the server down
                    log.exception("request failed path=%s", self.path)
                    code, ctype, body = 500, "application/json", json.dumps({"error": str(e)}).encode()
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("http " + format, *args)

    return Handler


def serve(agent: Agent, host: str, port: int) -> ThreadingHTTPServer:
    """Start the HTTP server in a daemon thread and return it (`.shutdown()` to stop)."""
    server = ThreadingHTTPServer((host, port), make_handler(agent, make_registry(agent)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="dlo-agent-http", daemon=True).start()
    log.info("agent listening host=%s port=%d", host, server.server_address[1])
    return server


def publish_loop(agent: Agent, annotate: Callable[[str], None], stop: threading.Event, interval_s: float) -> None:
    """Patch the node annotation whenever the profile changes (checked every `interval_s`)."""
    last = None
    while not stop.is_set():
        try:
            value = agent.profile().to_annotation()
            if value != last:
                annotate(value)
                last = value
                log.info("node profile published bytes=%d", len(value))
        except Exception as e:  # API down or forbidden: retry next round, keep serving metrics
            log.warning("node profile publish failed error=%s", e)
        stop.wait(interval_s)


def warm_loop(agent: Agent, stop: threading.Event, interval_s: float) -> None:
    while not stop.is_set():
        agent.warm_models()
        stop.wait(interval_s)
