"""This node's engines: the pods on the node, their metrics endpoints, and the node annotation.

Owns: `PodInfo` (what the agent needs of a pod), the `PodSource` interface and its Kubernetes
implementation (`KubernetesPods`: the listing and the watch of pods with a `spec.nodeName` field
selector, and the patch of this node's `dlo.dev/node-profile` annotation), which pods are DLO engines
(`app.kubernetes.io/part-of=dlo,app.kubernetes.io/component=engine`) and where to scrape them
(`engine_targets`), and reading an engine's `dlo_host_pinned_bytes` (`scrape_pinned`: one deadline
for the whole answer, connect included, and a byte bound on its body; an engine that trickles or
sends too much is `ScrapeSkipped`, never waited for).
Must never: import torch, wait on an engine past the scrape's deadline or read more than its bound, patch any node but its own or any annotation but `dlo.dev/node-profile`,
or cache anything (`dlo.agent.podwatch` keeps the pods a watch reports; `dlo.agent.node` the rest).
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.parser import text_string_to_metric_families

from dlo.plan.profile import ANNOTATION

PART_OF_DLO = ("app.kubernetes.io/part-of", "dlo")
ENGINE_COMPONENT = ("app.kubernetes.io/component", "engine")
DEFAULT_ENGINE_PORT = 8000
SCRAPE_TIMEOUT_S = 2.0  # the whole scrape of one engine: connect, head and body
MAX_METRICS_BYTES = 8 * 2**20  # an engine's exposition is tens of KB; past this it is not one
LIST_TIMEOUT_S = 30.0  # one listing of the node's pods (connect, and read)


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
        self._selector = f"spec.nodeName={node_name}"

    def pods(self) -> list[PodInfo]:
        return self.list_pods()[0]

    def list_pods(self) -> tuple[list[PodInfo], str]:
        """This node's pods and the listing's resourceVersion (a watch resumes from it). Served from
        the API server's watch cache (`resourceVersion=0`), as informers list."""
        resp = self.api.list_pod_for_all_namespaces(field_selector=self._selector, resource_version="0",
                                                    _preload_content=False, _request_timeout=LIST_TIMEOUT_S)
        body = json.loads(resp.data)
        pods = [info for item in body.get("items") or [] if (info := self.pod_info(item)) is not None]
        return pods, str((body.get("metadata") or {}).get("resourceVersion") or "")

    def watch_pods(self, resource_version: str, timeout_s: float,
                   read_timeout_s: float) -> Iterator[tuple[str, dict[str, Any]]]:
        """(type, raw object) of each change of this node's pods after `resource_version`, BOOKMARK
        included, until the server ends the watch (after `timeout_s`). ApiException 410: too old,
        list again; urllib3's ReadTimeoutError: nothing came for `read_timeout_s`."""
        from kubernetes import watch

        stream = watch.Watch().stream(
            self.api.list_pod_for_all_namespaces, field_selector=self._selector, resource_version=resource_version,
            timeout_seconds=max(1, int(timeout_s)), allow_watch_bookmarks=True,
            _request_timeout=(LIST_TIMEOUT_S, read_timeout_s))
        for event in stream:  # (`deserialize=False` would skip the client's check of ERROR events)
            yield str(event.get("type", "")), dict(event.get("raw_object") or {})

    def pod_info(self, obj: dict[str, Any]) -> PodInfo | None:
        """What the agent needs of a pod (its raw API object); None for a pod of another node (the
        field selector already leaves those out on a real API server)."""
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        if spec.get("nodeName") != self.node_name:
            return None
        port = None
        for c in spec.get("containers") or []:
            for cp in c.get("ports") or []:
                if cp.get("name") == "http":
                    port = cp.get("containerPort")
        return PodInfo(uid=str(meta.get("uid", "")), namespace=str(meta.get("namespace", "")),
                       name=str(meta.get("name", "")), ip=(obj.get("status") or {}).get("podIP"),
                       labels=dict(meta.get("labels") or {}), http_port=port)

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
