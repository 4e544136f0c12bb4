"""Leader election on a `coordination.k8s.io/v1` Lease, as controller-runtime does it: one operator
replica reconciles, the others wait, and one takes over within the lease's duration when the
leader dies.

Owns: `LeaseSettings` (the lease's name and namespace, this replica's identity, and the timing:
duration 15 s, renew deadline 10 s, retry 2 s, as controller-runtime's defaults), `Elector` (one
try to take or renew the lease, with optimistic concurrency on its resourceVersion; a lease held
by another is expired when its record has not changed for its duration by this replica's own
clock, never by comparing the holder's timestamps; `release`), and `lead`: wait for the lease, run
the operator while a thread renews it, and stop it when no renewal succeeded within the renew
deadline. `fenced` is set the moment leadership is lost: the operator's client refuses writes from
then on (`Kube.fence`), so a leader cut off from the API server never writes after another took
over (the deadline, 10 s, is shorter than the duration, 15 s, another waits).
Also `identity` and `lease_namespace` (from the pod's downward API, else the host) and
`serve_standby_health`: a standby answers the liveness probe before kopf (which serves it once
leading) runs.
Must never: run the operator before holding the lease, or release a lease it lost.
"""

from __future__ import annotations

import datetime
import http.server
import logging
import os
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import urllib3

from dlo.operator import metrics
from dlo.operator.kube import Kube, KubeError

log = logging.getLogger(__name__)
LEASE_API = "coordination.k8s.io/v1"


@dataclass(frozen=True)
class LeaseSettings:
    identity: str  # this replica: its pod name and a random suffix
    name: str = "dlo-operator"
    namespace: str = "default"
    duration_s: float = 15.0  # another replica takes the lease this long after its last renewal
    renew_deadline_s: float = 10.0  # the leader stops when it could not renew for this long
    retry_s: float = 2.0  # between two tries (renewals, or a standby's attempts)


def _micro_time(at: float) -> str:
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Elector:
    def __init__(self, kube: Kube, settings: LeaseSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.settings = settings
        self.clock = clock
        self.fenced = threading.Event()  # set once leadership is lost: no write from this replica after it
        self.releases = True  # False: leave the lease to expire (what a crash does)
        self._observed: tuple[Any, ...] | None = None  # the lease's record as last seen
        self._observed_at = 0.0  # when it was last seen to change, by this replica's clock

    def holder(self) -> str:
        lease = self.kube.get(LEASE_API, "Lease", self.settings.namespace, self.settings.name)
        return ((lease or {}).get("spec") or {}).get("holderIdentity") or ""

    def try_acquire_or_renew(self) -> bool:
        """One try: True when this replica holds the lease now (taken or renewed)."""
        s = self.settings
        lease = self.kube.get(LEASE_API, "Lease", s.namespace, s.name)
        now = self.clock()
        if lease is None:
            return self._create(now)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime"), spec.get("leaseTransitions"))
        if record != self._observed:
            self._observed, self._observed_at = record, now
        duration = spec.get("leaseDurationSeconds") or s.duration_s
        if holder and holder != s.identity and now < self._observed_at + duration:
            return False  # another replica's, not expired
        stamp = _micro_time(time.time())
        new = {"holderIdentity": s.identity, "leaseDurationSeconds": int(s.duration_s), "renewTime": stamp,
               "acquireTime": spec.get("acquireTime") if holder == s.identity else stamp,
               "leaseTransitions": int(spec.get("leaseTransitions") or 0) + (holder != s.identity)}
        try:  # the resourceVersion read is a precondition: a conflict means another replica wrote first
            self.kube.patch(LEASE_API, "Lease", s.namespace, s.name,
                            {"metadata": {"resourceVersion": lease["metadata"].get("resourceVersion")}, "spec": new})
        except KubeError as e:
            if e.status in (409, 422):
                return False
            raise
        if holder != s.identity:
            log.info("took the lease %s/%s (held by %r before)", s.namespace, s.name, holder)
        self._observed, self._observed_at = (s.identity, stamp, new["leaseTransitions"]), now
        return True

    def _create(self, now: float) -> bool:
        s = self.settings
        stamp = _micro_time(time.time())
        lease = {"apiVersion": LEASE_API, "kind": "Lease", "metadata": {"name": s.name, "namespace": s.namespace},
                 "spec": {"holderIdentity": s.identity, "leaseDurationSeconds": int(s.duration_s),
                          "acquireTime": stamp, "renewTime": stamp, "leaseTransitions": 0}}
        if not self.kube.create_once(lease):
            return False
        log.info("created and took the lease %s/%s", s.namespace, s.name)
        self._observed, self._observed_at = (s.identity, stamp, 0), now
        return True

    def release(self) -> None:
        """Hand the lease over at once (a standby need not wait for it to expire): no holder."""
        s = self.settings
        if not self.releases or self.fenced.is_set():
            return
        try:
            lease = self.kube.get(LEASE_API, "Lease", s.namespace, s.name)
            if ((lease or {}).get("spec") or {}).get("holderIdentity") != s.identity:
                return
            stamp = _micro_time(time.time())
            self.kube.patch(LEASE_API, "Lease", s.namespace, s.name, {
                "metadata": {"resourceVersion": lease["metadata"].get("resourceVersion")},
                "spec": {"holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": stamp, "acquireTime": stamp}})
            log.info("released the lease %s/%s", s.namespace, s.name)
        except (KubeError, urllib3.exceptions.HTTPError) as e:
            log.warning("could not release the lease %s/%s: %s", s.namespace, s.name, e)


def _try(elector: Elector) -> bool:
    try:
        return elector.try_acquire_or_renew()
    except (KubeError, urllib3.exceptions.HTTPError) as e:
        log.warning("lease %s/%s: %s", elector.settings.namespace, elector.settings.name, e)
        return False


def _renew(elector: Elector, halt: threading.Event, stop: threading.Event) -> None:
    """Renew every retry; past the renew deadline without one, fence and halt the operator."""
    s = elector.settings
    last = elector.clock()
    while not halt.wait(s.retry_s):
        if stop.is_set():
            halt.set()
            return
        if _try(elector):
            last = elector.clock()
        elif elector.clock() - last >= s.renew_deadline_s:
            elector.fenced.set()
            metrics.LEADING.set(0)
            log.error("lost the lease %s/%s: no renewal for %.0f s; stopping", s.namespace, s.name, s.renew_deadline_s)
            halt.set()
            return


def lead(elector: Elector, operate: Callable[[threading.Event], None], stop: threading.Event) -> bool:
    """Wait for the lease (until `stop`), then `operate(halt)` (it blocks: kopf.run with stop_flag=halt)
    while a thread renews the lease; `halt` is set on `stop` or when leadership is lost. Returns
    False when it was lost (the caller exits non-zero: the pod restarts as a standby)."""
    s = elector.settings
    waiting_for = None
    while not _try(elector):
        holder = waiting_for
        try:
            holder = elector.holder()
        except (KubeError, urllib3.exceptions.HTTPError):
            pass
        if holder != waiting_for:
            log.info("standing by: the lease %s/%s is held by %r", s.namespace, s.name, holder)
            waiting_for = holder
        if stop.wait(s.retry_s):
            return True
    metrics.LEADING.set(1)
    halt = threading.Event()
    renewer = threading.Thread(target=_renew, args=(elector, halt, stop), name="lease-renewer", daemon=True)
    renewer.start()
    try:
        operate(halt)
    finally:
        halt.set()
        renewer.join()
        metrics.LEADING.set(0)
    if elector.fenced.is_set():
        return False
    elector.release()
    return True


SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def identity() -> str:
    """This replica in the lease: its pod's name (POD_NAME, the chart's downward API; else the host
    name) and a random suffix, so a restarted pod of the same name is another holder."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def lease_namespace() -> str:
    """Where the lease lives: POD_NAMESPACE (the chart's downward API), else the service account's
    namespace, else default."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(SA_NAMESPACE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


def serve_standby_health(url: str) -> http.server.ThreadingHTTPServer | None:
    """Answer the liveness probe at `url` (kopf's endpoint, not running yet) while standing by;
    `shutdown()` and `server_close()` it before kopf takes the port. None for no URL."""
    if not url:
        return None
    parsed = urllib.parse.urlsplit(url)
    path = parsed.path or "/"

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200 if self.path.split("?")[0] == path else 404)
            self.end_headers()
            self.wfile.write(b"standby\n")

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer((parsed.hostname or "0.0.0.0", parsed.port or 80), Health)
    threading.Thread(target=server.serve_forever, name="standby-health", daemon=True).start()
    return server
