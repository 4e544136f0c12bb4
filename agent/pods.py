"""This node's engines: the pods on the node, their metrics endpoints, and the node annotation.

Owns: `PodInfo` (what the agent needs of a pod), the `PodSource` interface and its Kubernetes
implementation (`KubernetesPods`: pods with a `spec.nodeName` field selector, and the patch of this
node's `dlo.dev/node-profile` annotation), which pods are DLO engines
(`app.kubernetes.io/part-of=dlo,app.kubernetes.io/component=engine`) and where to scrape them
(`engine_targets`), and reading an engine's `dlo_host_pinned_bytes` (`scrape_pinned`: one deadline
for the whole answer, connect included, and a byte bound on its body; an engine that trickles or
sends too much is `ScrapeSkipped`, never waited for).
Must never: import torch, wait on an engine past the scrape's deadline or read more than its bound, patch any node but its own or any annotation but `dlo.dev/node-profile`,
or cache anything (the node agent decides how often to list; `dlo.agent.node`).
"""

from __future__ import annotations

import http.client
import time
import urllib.parse
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.parser import text_string_to_metric_families

from dlo.plan.profile import ANNOTATION

PART_OF_DLO = ("app.kubernetes.io/part-of", "dlo")
ENGINE_COMPONENT = ("app.kubernetes.io/component", "engine")
DEFAULT_ENGINE_PORT = 8000
SCRAPE_TIMEOUT_S = 2.0  # the whole scrape of one engine: connect, head and body
MAX_METRICS_BYTES = 8 * 2**20  # an engine's exposition is tens of KB; past this it is not one


class ScrapeSkipped(Exception):
    """An engine not scraped: `reason` is `timeout`, `too_large`, `status` or `error`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


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
        return self.is_dlo and self.labels.get(ENGINE_COMPONENT[0]) == ENGINE_COMPONENT[1]


@dataclass(frozen=True)
class EngineTarget:
    url: str  # base URL; /metrics is appended
    namespace: str
    pod: str


class PodSource(Protocol):
    def pods(self) -> list[PodInfo]: ...


def engine_targets(engine_urls: list[str], pods: list[PodInfo]) -> list[EngineTarget]:
    """Engines to scrape: the `--engine-url`s (labelled by URL), then the DLO engine pods with an IP."""
    targets = [EngineTarget(u, "", u) for u in engine_urls]
    for p in pods:
        if p.is_engine and p.ip:
            targets.append(EngineTarget(f"http://{p.ip}:{p.http_port or DEFAULT_ENGINE_PORT}", p.namespace, p.name))
    return targets


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


def fetch_metrics(url: str, timeout: float = SCRAPE_TIMEOUT_S, max_bytes: int = MAX_METRICS_BYTES) -> str:
    """The text of `url`/metrics, read within `timeout` seconds in all and at most `max_bytes`;
    else ScrapeSkipped."""
    parts = urllib.parse.urlsplit(url.rstrip("/") + "/metrics")
    if parts.scheme != "http" or not parts.hostname:
        raise ScrapeSkipped("error", f"{url}: not an http:// URL")
    ends = time.monotonic() + timeout
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    try:
        conn.request("GET", parts.path, headers={"Accept": "text/plain"})
        _bound(conn, ends)
        resp = conn.getresponse()
        if resp.status != 200:
            raise ScrapeSkipped("status", f"{url}/metrics answered HTTP {resp.status}")
        body = bytearray()
        while True:
            _bound(conn, ends)
            chunk = resp.read1(65536)
            if not chunk:
                break
            body += chunk
            if len(body) > max_bytes:
                raise ScrapeSkipped("too_large", f"{url}/metrics sent more than {max_bytes} bytes")
        return body.decode("utf-8", "replace")
    except TimeoutError:
        raise ScrapeSkipped("timeout", f"{url}/metrics did not answer in full within {timeout:g} s") from None
    except (OSError, http.client.HTTPException) as e:
        raise ScrapeSkipped("error", f"{url}/metrics: {e}") from None
    finally:
        conn.close()


def _bound(conn: http.client.HTTPConnection, ends: float) -> None:
    """The next read of `conn` may block only until `ends` (TimeoutError once it has passed)."""
    left = ends - time.monotonic()
    if left <= 0:
        raise TimeoutError
    if conn.sock is not None:
        conn.sock.settimeout(left)


def scrape_pinned(url: str, timeout: float = SCRAPE_TIMEOUT_S, max_bytes: int = MAX_METRICS_BYTES) -> dict[str, float]:
    """An engine's `dlo_host_pinned_bytes` for the whole pod, by `source`: private arenas
    (`shared="false"`) add up over ranks; the registered page cache (`shared="true"`) is one set of
    pages every rank registers, so it counts once (the largest rank's figure). ScrapeSkipped when
    the engine does not answer in full within `timeout` or sends more than `max_bytes`."""
    text = fetch_metrics(url, timeout, max_bytes)
    out: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as e:
        raise ScrapeSkipped("error", f"{url}/metrics is not Prometheus text: {e}") from None
    for family in families:
        if family.name != "dlo_host_pinned_bytes":
            continue
        for s in family.samples:
            source = s.labels.get("source", "unknown")
            if s.labels.get("shared") == "true":
                out[source] = max(out.get(source, 0.0), s.value)
            else:
                out[source] = out.get(source, 0.0) + s.value
    return out
