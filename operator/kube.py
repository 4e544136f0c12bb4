"""A small synchronous Kubernetes client for the objects the operator owns.

Owns: REST paths of the kinds the operator touches, get/list/create/merge-patch/delete, `apply`
(server-side apply with the field manager `dlo-operator`, forced: the operator is the one owner of
what it applies, and the API server removes a field the operator stops applying: no diff or prune
here; a body applied before is not sent again while the object is as that apply left it), pod
logs, and the discovery check. Label and field selectors are also applied client-side, so a server
that ignores them cannot widen a listing. Failed requests are counted in `metrics.API_ERRORS`.
Must never: decide what to create (that is `builders`) or hold state beyond the connection, what
it last applied (the resourceVersion and generation answered, the body's digest) and discovery
answers (a minute); write once its `fence` is set (a leader that lost its lease).
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import urllib.parse
from typing import Any

import kubernetes
import urllib3

from dlo.operator import metrics

log = logging.getLogger(__name__)

# kind -> plural; the API group/version comes from each object's apiVersion.
PLURALS = {
    "Pod": "pods",
    "Service": "services",
    "Secret": "secrets",
    "Node": "nodes",
    "Event": "events",
    "Job": "jobs",
    "StatefulSet": "statefulsets",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "NetworkPolicy": "networkpolicies",
    "PodMonitor": "podmonitors",
    "ServiceMonitor": "servicemonitors",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "ScaledObject": "scaledobjects",
    "DLODeployment": "dlodeployments",
    "CustomResourceDefinition": "customresourcedefinitions",
    "Lease": "leases",
}
CLUSTER_SCOPED = {"Node", "CustomResourceDefinition"}
USER_AGENT = "dlo-operator"
FIELD_MANAGER = "dlo-operator"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"  # JSON is YAML: the body is sent as JSON
# Seconds one API call may take (connect + read). Without a bound, an API server that stops
# answering mid-request would hold a handler thread forever and the resource would never reconcile
# again; with it the call fails, the reconcile fails, and the next round retries.
REQUEST_TIMEOUT_S = 30.0
DISCOVERY_TTL_S = 60.0
# An object applied unchanged is not applied again for this long (unless the caller knows it
# changed); after it, once more: what corrects a child someone else changed that no watch reports.
REAPPLY_S = 300.0


class KubeError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, message: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {message}")
        self.status = status


def _path(api_version: str, kind: str, namespace: str | None, name: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if kind not in CLUSTER_SCOPED and namespace:
        base += f"/namespaces/{namespace}"
    base += f"/{PLURALS[kind]}"
    return f"{base}/{name}" if name else base


def matches(obj: dict[str, Any], labels: dict[str, str] | None = None, fields: dict[str, str] | None = None) -> bool:
    """Whether `obj` has every label in `labels` and every dotted field in `fields` (selector semantics)."""
    have = obj.get("metadata", {}).get("labels") or {}
    if any(have.get(k) != v for k, v in (labels or {}).items()):
        return False
    for dotted, want in (fields or {}).items():
        value: Any = obj
        for part in dotted.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if str(value) != want:
            return False
    return True


class Kube:
    def __init__(self, api_client: kubernetes.client.ApiClient, timeout: float = REQUEST_TIMEOUT_S) -> None:
        # The client's configuration (host, TLS, token with its refresh hook) and its connection
        # pool; requests are sent through urllib3 directly, the same way on every client version.
        self._config = api_client.configuration
        self._pool = api_client.rest_client.pool_manager
        self.user_agent = USER_AGENT  # the operator's own calls, recognisable in audit logs
        self.timeout = timeout
        self._applied: dict[str, str] = {}  # object path -> resourceVersion of its last apply
        # object path -> (digest of the body applied, when, the generation the server answered)
        self._bodies: dict[str, tuple[str, float, int | None]] = {}
        self._discovered: dict[tuple[str, str], tuple[float, bool]] = {}
        self._lock = threading.Lock()
        # Set when this replica lost the leader election (`leader.Elector.fenced`): every write is
        # refused from then on, so a deposed leader never writes after another took over.
        self.fence: threading.Event | None = None

    @classmethod
    def from_environment(cls) -> Kube:
        """In a pod: its service account; elsewhere: the current kubeconfig context."""
        config = kubernetes.client.Configuration()
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=config)
        return cls(kubernetes.client.ApiClient(config))

    @classmethod
    def for_url(cls, url: str, timeout: float = REQUEST_TIMEOUT_S) -> Kube:
        config = kubernetes.client.Configuration(host=url.rstrip("/"))
        return cls(kubernetes.client.ApiClient(config), timeout)

    def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
             query: list | None = None, accept: str = "application/json") -> tuple[int, bytes]:
        """One request; (status, raw body). Raises KubeError for an error answer."""
        if self.fence is not None and self.fence.is_set() and method != "GET":
            raise KubeError(0, method, path, "not the leader any more (the lease was lost): no writes")
        headers = {"Accept": accept, "User-Agent": self.user_agent}
        if body is not None:
            headers["Content-Type"] = content_type
        for auth in self._config.auth_settings().values():
            if auth.get("in") == "header" and auth.get("value"):
                headers[auth["key"]] = auth["value"]
        url = self._config.host + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = json.dumps(body).encode() if body is not None else None
        try:
            response = self._pool.request(method, url, body=data, headers=headers, retries=False,
                                          timeout=urllib3.Timeout(total=self.timeout))
        except urllib3.exceptions.HTTPError:
            metrics.API_ERRORS.labels("none").inc()
            raise
        raw = response.data
        if response.status >= 400:
            if response.status != 404:  # "not there" is an answer (a child not created yet)
                metrics.API_ERRORS.labels(str(response.status)).inc()
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = None
            message = payload.get("message", "") if isinstance(payload, dict) else str(raw[:200])
            raise KubeError(response.status, method, path, message)
        return response.status, raw

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                query: list | None = None) -> Any:
        _, raw = self.call(method, path, body, content_type, query)
        return json.loads(raw) if raw else None

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", _path(api_version, kind, namespace, name))
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str | None = None, labels: dict[str, str] | None = None,
             fields: dict[str, str] | None = None) -> list[dict[str, Any]]:
        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in labels.items()))] if labels else []
        if fields:
            query.append(("fieldSelector", ",".join(f"{k}={v}" for k, v in fields.items())))
        items = self.request("GET", _path(api_version, kind, namespace), query=query).get("items", [])
        return [i for i in items if matches(i, labels, fields)]

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return self.request("POST", _path(obj["apiVersion"], obj["kind"], meta.get("namespace")), body=obj)

    def create_once(self, obj: dict[str, Any]) -> bool:
        """Create `obj` unless it exists (AlreadyExists is an answer): True when this call made it.
        For objects the API keeps immutable once made (a Job's template)."""
        try:
            self.create(obj)
        except KubeError as e:
            if e.status == 409:
                return False
            raise
        return True

    def patch(self, api_version: str, kind: str, namespace: str | None, name: str, patch: dict[str, Any],
              subresource: str = "") -> dict[str, Any]:
        path = _path(api_version, kind, namespace, name) + (f"/{subresource}" if subresource else "")
        return self.request("PATCH", path, body=patch, content_type="application/merge-patch+json")

    def remove_finalizer(self, api_version: str, kind: str, namespace: str | None, name: str, finalizer: str,
                         finalizers: list[str]) -> None:
        """Drop `finalizer` from the object's finalizers as read (`finalizers`): a JSON patch whose
        test fails (409/422) when another writer changed them since, instead of dropping theirs."""
        patch = [{"op": "test", "path": "/metadata/finalizers", "value": finalizers},
                 {"op": "replace", "path": "/metadata/finalizers", "value": [f for f in finalizers if f != finalizer]}]
        self.request("PATCH", _path(api_version, kind, namespace, name), body=patch,
                     content_type="application/json-patch+json")

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str,
               propagation: str | None = None, uid: str | None = None, grace_seconds: int | None = None) -> bool:
        """Delete the object; False where it is gone already, or (`uid` given: a precondition) where
        the object of that name is another one now (the server answers 409: a stale read never
        deletes the object that replaced the one it saw). `grace_seconds` 0: a force delete (a pod
        is removed without waiting for its kubelet)."""
        options: dict[str, Any] = {}
        if propagation:
            options["propagationPolicy"] = propagation
        if uid:
            options["preconditions"] = {"uid": uid}
        if grace_seconds is not None:
            options["gracePeriodSeconds"] = grace_seconds
        body = {"kind": "DeleteOptions", "apiVersion": "v1", **options} if options else None
        try:
            self.request("DELETE", _path(api_version, kind, namespace, name), body=body)
        except KubeError as e:
            if e.status == 404 or (uid and e.status == 409):
                return False
            raise
        return True

    def apply(self, obj: dict[str, Any], live_generation: int | None = None) -> str:
        """Server-side apply `obj` (field manager dlo-operator, forced). Returns `created` (201),
        `patched` (the object changed since this client last applied it), or `unchanged` (the same
        resourceVersion came back, or this client had not applied it since it started). No call when
        this client applied the same body before and the object is as it left it: `live_generation`
        (a watch's) is the generation that apply answered, or, without a watch, the apply is less
        than REAPPLY_S old."""
        meta = obj["metadata"]
        path = _path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        digest = hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()
        with self._lock:
            last = self._bodies.get(path)
        if last is not None and last[0] == digest:
            if (live_generation is not None and live_generation == last[2]) or (
                    live_generation is None and time.monotonic() - last[1] < REAPPLY_S):
                return "unchanged"
        status, raw = self.call("PATCH", path, body=obj, content_type=APPLY_CONTENT_TYPE,
                                query=[("fieldManager", FIELD_MANAGER), ("force", "true")])
        answer = (json.loads(raw).get("metadata") or {}) if raw else {}
        version = answer.get("resourceVersion", "")
        with self._lock:
            before = self._applied.get(path)
            self._applied[path] = version
            self._bodies[path] = (digest, time.monotonic(), answer.get("generation"))
        if status == 201:
            return "created"
        return "patched" if before is not None and before != version else "unchanged"

    def pod_log(self, namespace: str, name: str, container: str, tail_lines: int = 20) -> str:
        """The last lines a pod's container printed ('' when there is no log yet)."""
        path = _path("v1", "Pod", namespace, name) + "/log"
        try:
            _, raw = self.call("GET", path, query=[("container", container), ("tailLines", str(tail_lines))],
                               accept="text/plain")
        except KubeError as e:
            if e.status in (400, 404):  # not started yet, or gone
                return ""
            raise
        return raw.decode(errors="replace")

    def has_resource(self, api_version: str, plural: str) -> bool:
        """Whether the server serves `plural` in `api_version` (e.g. a monitoring CRD is installed),
        asked at most once a minute (a CRD installed later is seen within that)."""
        now = time.monotonic()
        hit = self._discovered.get((api_version, plural))
        if hit is None or now - hit[0] > DISCOVERY_TTL_S:
            hit = (now, self._discover(api_version, plural))
            self._discovered[(api_version, plural)] = hit
        return hit[1]

    def _discover(self, api_version: str, plural: str) -> bool:
        try:
            listing = self.request("GET", f"/apis/{api_version}")
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        return any(r.get("name") == plural for r in (listing or {}).get("resources", []))
