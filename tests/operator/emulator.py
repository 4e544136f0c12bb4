"""The kmock API emulator with what the operator needs of a real API server that kmock lacks.

- metadata: uid, resourceVersion, creationTimestamp and generation (bumped on spec changes);
- server-side apply (`application/apply-patch+yaml`): per field manager, the last applied
  configuration is kept; a field the manager applied before and applies no more is removed, fields
  of other writers are kept (lists are atomic: the operator is the only writer of the lists it
  applies), an apply to a missing object creates it (201), and an apply that changes nothing is
  answered without a write (same resourceVersion, no watch event), as the real server does;
- merge patches that change nothing are no writes either;
- pod logs (`pods/NAME/log`): served from what `logs` holds for the pod (the local kubelet
  registers its containers' log files);
- a stale JSON-patch test answers 422 (kmock: 500), and a merge patch naming another
  `metadata.resourceVersion` than the object's answers 409 (optimistic concurrency: the leases);
- a DELETE whose `preconditions.uid` is not the object's answers 409 and deletes nothing (kmock
  ignores the body);
- a request for one object is answered by a dict lookup (kmock scans every object);
- graceful pod deletion where no kubelet confirms it: a pod bound to a node whose Ready condition
  is not True is only marked (deletionTimestamp, and a finalizer of the emulator's that stands for
  the kubelet's confirmation) and stays Terminating; a force delete (`gracePeriodSeconds: 0`) removes
  it, as the pod garbage collector or a returning kubelet (`controllers.NodeLifecycle`) does.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import json
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp.web
import jsonpatch
import kmock

_counter = itertools.count(1)
APPLY = "application/apply-patch+yaml"
HELD = "emulator.dlo.dev/kubelet"  # a pod deleted on a lost node: its kubelet never confirms


def node_ready(node: dict[str, Any]) -> bool:
    """A node without a Ready condition (the tests' plain nodes) is ready."""
    ready = next((c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"), None)
    return ready is None or ready.get("status") == "True"


def now() -> str:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge(out.get(key), value)
    return out


def removed(previous: Any, current: Any) -> dict[str, Any]:
    """A merge patch of nulls for the fields `previous` set that `current` no longer sets."""
    out: dict[str, Any] = {}
    if not isinstance(previous, dict):
        return out
    for key, value in previous.items():
        if not isinstance(current, dict) or key not in current:
            out[key] = None
        elif isinstance(value, dict) and isinstance(current[key], dict):
            below = removed(value, current[key])
            if below:
                out[key] = below
    return out


class Emulator(kmock.KubernetesEmulator):
    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.applied: dict[tuple[Any, str | None, str, str], dict[str, Any]] = {}
        self.logs: dict[tuple[str, str], Callable[[], str]] = {}

    def current(self, request: Any) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        return self.objects[key].raw if key in self.objects and not self.objects[key].deleted else None

    async def _handle(self, request):  # type: ignore[override]
        if request.resource is not None and request.subresource == "log" and request.method.value == "GET":
            source = self.logs.get((request.namespace, request.name))
            if source is None:
                raise kmock.KubernetesError(status=400, reason="BadRequest", message="container is not running")
            tail = int(request.params.get("tailLines") or 0)
            lines = source().splitlines(keepends=True)
            return aiohttp.web.Response(text="".join(lines[-tail:] if tail else lines))
        if request.action == kmock.action.DELETE and request.name:
            self._check_preconditions(request)
            held = await self._pod_delete(request)
            if held is not None:
                return held
        if request.action == kmock.action.UPDATE and request.headers.get("Content-Type", "").startswith(APPLY):
            answer = await self._apply(request)
            if answer is not None:
                return answer
        elif request.action == kmock.action.UPDATE and isinstance(request.data, dict) and request.name:
            current = self.current(request)
            wanted = (request.data.get("metadata") or {}).get("resourceVersion")
            if current is not None and wanted and wanted != current["metadata"].get("resourceVersion"):
                raise kmock.KubernetesError(status=409, reason="Conflict", message=(
                    "Operation cannot be fulfilled: the object has been modified; please apply your changes to "
                    "the latest version and try again"))
            if current is not None and merge(current, request.data) == current:
                return aiohttp.web.json_response(current)  # a no-op patch: no write, no event
        self._assign_metadata(request)
        try:
            return await super()._handle(request)
        except jsonpatch.JsonPatchTestFailed as e:
            # A stale resourceVersion: a real API server answers 422 and the client re-reads.
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(e)) from None

    # kmock answers a request for one object by scanning every object it holds: a dict lookup
    # instead (the same key its writes use), so a fleet of thousands is served at the pace of one.
    def _one(self, request: Any) -> Any:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects:
            raise kmock.KubernetesError(status=404, reason="NotFound", message=f"{request.name} not found")
        return self.objects[key]

    async def _serve_fetch(self, request: Any) -> Any:  # type: ignore[override]
        obj = self._one(request)
        if obj.deleted:
            raise kmock.KubernetesError(status=404, reason="NotFound", message=f"{request.name} not found")
        return obj.raw

    async def _serve_update(self, request: Any) -> Any:  # type: ignore[override]
        return self._one(request).last.raw

    async def _serve_delete(self, request: Any) -> Any:  # type: ignore[override]
        return self._one(request).last.raw

    async def _serve_create(self, request: Any) -> Any:  # type: ignore[override]
        meta = request.data.get("metadata", {})
        key = (request.resource, request.namespace or meta.get("namespace"), request.name or meta.get("name"))
        return self.objects[key].raw

    def _node(self, name: str | None) -> dict[str, Any] | None:
        return next((obj.raw for (resource, _, n), obj in self.objects.items()
                     if resource.plural == "nodes" and n == name and not obj.deleted), None)

    async def _pod_delete(self, request: Any) -> Any:
        """A pod's DELETE where no kubelet confirms it (its node is not Ready): marked, kept; a force
        delete of such a pod removes it. None: an ordinary delete (handled on)."""
        if request.resource is None or request.resource.plural != "pods":
            return None
        current = self.current(request)
        options = request.data if isinstance(request.data, dict) else {}
        grace = options.get("gracePeriodSeconds", request.params.get("gracePeriodSeconds"))
        force = grace is not None and int(grace) == 0
        if current is None:
            return None
        key = (request.resource, request.namespace, request.name)
        held = HELD in (current["metadata"].get("finalizers") or [])
        node = self._node((current.get("spec") or {}).get("nodeName"))
        if force and held:
            async with self._lock:
                raw = self.objects[key].raw
                self.objects[key].delete()
                await self._buses[request.resource].put({"type": "DELETED", "object": raw})
            return aiohttp.web.json_response(raw)
        if force or held or node is None or node_ready(node):
            return None
        async with self._lock:
            self.objects[key].patch({"metadata": {"deletionTimestamp": now(), "finalizers": [HELD],
                                                  "deletionGracePeriodSeconds": int(grace or 30),
                                                  "resourceVersion": str(next(_counter))}})
            raw = self.objects[key].raw
            await self._buses[request.resource].put({"type": "MODIFIED", "object": raw})
        return aiohttp.web.json_response(raw)

    def _check_preconditions(self, request: Any) -> None:
        uid = ((request.data if isinstance(request.data, dict) else {}).get("preconditions") or {}).get("uid")
        current = self.current(request)
        if uid and current is not None and current["metadata"].get("uid") != uid:
            raise kmock.KubernetesError(status=409, reason="Conflict", message=(
                f"Precondition failed: UID in precondition: {uid}, UID in object meta: {current['metadata'].get('uid')}"))

    async def _apply(self, request: Any) -> Any:
        """Server-side apply: None when it became an ordinary merge patch (handled on)."""
        manager = request.params.get("fieldManager", "")
        config = json.loads(json.dumps(request.data))
        key = (request.resource, request.namespace, request.name, manager)
        current = self.current(request)
        previous = self.applied.get(key)
        self.applied[key] = config
        if current is None:
            obj = copy.deepcopy(config)
            meta = obj.setdefault("metadata", {})
            meta.update(uid=str(uuid.uuid4()), resourceVersion=str(next(_counter)), creationTimestamp=now(),
                        generation=1)
            obj_key = (request.resource, request.namespace, request.name)
            async with self._lock:
                self.objects[obj_key] = obj
                await self._buses[request.resource].put({"type": "ADDED", "object": obj})
            return aiohttp.web.json_response(obj, status=201)
        patch = merge(removed(previous, config), config)
        if merge(current, patch) == current:
            return aiohttp.web.json_response(current)
        request.data.clear()
        request.data.update(patch)
        return None

    def _assign_metadata(self, request: Any) -> None:
        data = request.data
        if request.resource is not None and request.action == kmock.action.CREATE and isinstance(data, dict):
            meta = data.setdefault("metadata", {})
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
            meta.setdefault("uid", str(uuid.uuid4()))
            meta["resourceVersion"] = str(next(_counter))
            meta.setdefault("creationTimestamp", now())
            meta.setdefault("generation", 1)
        elif request.resource is not None and request.action == kmock.action.UPDATE and request.name:
            current = self.current(request)
            generation = ((current or {}).get("metadata", {}).get("generation") or 1)
            rv = str(next(_counter))
            if isinstance(data, dict):
                meta = data.setdefault("metadata", {})
                meta["resourceVersion"] = rv
                spec_changed = "spec" in data and merge((current or {}).get("spec"), data["spec"]) != (current or {}).get("spec")
                if spec_changed and request.subresource != "status":
                    meta["generation"] = generation + 1
            elif isinstance(data, list):
                data.append({"op": "replace", "path": "/metadata/resourceVersion", "value": rv})


def live_objects(emulator: Emulator) -> list[dict[str, Any]]:
    return [obj.raw for (_, _, _), obj in emulator.objects.items() if not obj.deleted]
