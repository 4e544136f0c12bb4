"""A small synchronous Kubernetes client for the objects the operator owns.

Owns: REST paths of the kinds the operator touches, get/list/create/merge-patch/delete, and
`apply` (create-or-patch, idempotent, AlreadyExists tolerated; no server-side apply). Label
selectors are also applied client-side, so a server that ignores them cannot widen a listing.
Failed requests are counted in `metrics.API_ERRORS`.
Must never: decide what to create (that is `builders`) or hold state beyond the connection.
"""

from __future__ import annotations

import json
import logging
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
    "StatefulSet": "statefulsets",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "PodMonitor": "podmonitors",
    "ServiceMonitor": "servicemonitors",
    "DLODeployment": "dlodeployments",
    "CustomResourceDefinition": "customresourcedefinitions",
}
CLUSTER_SCOPED = {"Node", "CustomResourceDefinition"}
USER_AGENT = "dlo-operator"
# Seconds one API call may take (connect + read). Without a bound, an API server that stops
# answering mid-request would hold a handler thread forever and the resource would never reconcile
# again; with it the call fails, the handler fails, and kopf (or the next timer round) retries.
REQUEST_TIMEOUT_S = 30.0


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


def contains(actual: Any, desired: Any) -> bool:
    """True when every field of `desired` is already present in `actual` with that value."""
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(contains(actual.get(k), v) for k, v in desired.items())
    if isinstance(desired, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(desired)
            and all(contains(a, d) for a, d in zip(actual, desired))
        )
    return actual == desired


class Kube:
    def __init__(self, api_client: kubernetes.client.ApiClient, timeout: float = REQUEST_TIMEOUT_S) -> None:
        self._api = api_client
        self._api.user_agent = USER_AGENT  # the operator's own calls, recognisable in audit logs
        self.timeout = timeout

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

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json", query: list | None = None
    ) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        m, url, hdrs, data, post = self._api.param_serialize(
            method, path, query_params=query or [], header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        try:
            response = self._api.call_api(m, url, hdrs, data, post, _request_timeout=self.timeout)
        except urllib3.exceptions.HTTPError:
            metrics.API_ERRORS.labels("none").inc()
            raise
        raw = response.read()
        payload = json.loads(raw) if raw else None
        if response.status >= 400:
            if response.status != 404:  # "not there" is an answer (a child not created yet)
                metrics.API_ERRORS.labels(str(response.status)).inc()
            message = payload.get("message", "") if isinstance(payload, dict) else str(raw[:200])
            raise KubeError(response.status, method, path, message)
        return payload

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", _path(api_version, kind, namespace, name))
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def list(
        self, api_version: str, kind: str, namespace: str | None = None, labels: dict[str, str] | None = None
    ) -> list[dict[str, Any]]:
        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in labels.items()))] if labels else []
        items = self.request("GET", _path(api_version, kind, namespace), query=query).get("items", [])
        if labels:
            items = [i for i in items if contains(i.get("metadata", {}).get("labels", {}), labels)]
        return items

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return self.request("POST", _path(obj["apiVersion"], obj["kind"], meta.get("namespace")), body=obj)

    def patch(
        self, api_version: str, kind: str, namespace: str | None, name: str, patch: dict[str, Any], subresource: str = ""
    ) -> dict[str, Any]:
        path = _path(api_version, kind, namespace, name) + (f"/{subresource}" if subresource else "")
        return self.request("PATCH", path, body=patch, content_type="application/merge-patch+json")

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        try:
            self.request("DELETE", _path(api_version, kind, namespace, name))
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        return True

    def apply(self, obj: dict[str, Any], prune: tuple[tuple[str, ...], ...] = ()) -> str:
        """Create `obj`, or merge-patch it where it differs. Returns created|patched|unchanged.

        A merge-patch never removes a field `obj` lacks; `prune` names the paths to remove when
        `obj` has nothing there (e.g. a StatefulSet's `rollingUpdate` after a switch to OnDelete).
        """
        meta = obj["metadata"]
        key = (obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        existing = self.get(*key)
        if existing is None:
            try:
                self.create(obj)
                return "created"
            except KubeError as e:
                if e.status != 409:
                    raise
                existing = self.get(*key) or {}
        desired = json.loads(json.dumps({k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}))
        for path in prune:
            parent = desired
            for part in path[:-1]:
                parent = parent.setdefault(part, {})
            parent.setdefault(path[-1], None)
        if contains(existing, desired):
            return "unchanged"
        self.patch(*key, desired)
        return "patched"

    def has_resource(self, api_version: str, plural: str) -> bool:
        """Whether the server serves `plural` in `api_version` (e.g. a monitoring CRD is installed)."""
        try:
            listing = self.request("GET", f"/apis/{api_version}")
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        return any(r.get("name") == plural for r in (listing or {}).get("resources", []))
