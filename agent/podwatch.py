"""This node's pods kept current by a watch, so that no scrape lists them.

Owns: `PodWatch`, a `PodSource` whose `pods()` answers from memory: one listing of the node's pods
(`spec.nodeName` field selector, from the API server's watch cache), then a watch from the
listing's resourceVersion, ended by the server after `watch_seconds` (jittered, so that the agents of
a fleet do not come back together) or silent past a read timeout, and resumed from the last
resourceVersion it reported (bookmarks included). A 410 Gone lists again at once; any other error lists again after a jittered backoff that
doubles up to `max_backoff_s`. The kubelet keeps its pods the same way.
Must never: list on a scrape, retry an API that fails without backing off, drop what it knew during
an outage (the last state stands until a listing replaces it), or import torch.
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Any

from urllib3.exceptions import ReadTimeoutError

from dlo.agent.pods import KubernetesPods, PodInfo

log = logging.getLogger(__name__)

WATCH_SECONDS = 300.0  # a watch's length before the server ends it and it resumes (+ up to 10 %)
MAX_BACKOFF_S = 60.0


class PodWatch:
    """This node's pods from one listing and a watch; `start` runs it on a daemon thread."""

    def __init__(self, source: KubernetesPods, *, watch_seconds: float = WATCH_SECONDS,
                 read_timeout_s: float | None = None, max_backoff_s: float = MAX_BACKOFF_S,
                 rng: random.Random | None = None) -> None:
        """`read_timeout_s`: a watch silent this long is resumed (default `watch_seconds` + 30 s: the
        server ends a watch itself, and sends bookmarks meanwhile)."""
        self.source = source
        self.watch_seconds, self.max_backoff_s = watch_seconds, max_backoff_s
        self.read_timeout_s = read_timeout_s if read_timeout_s is not None else watch_seconds + 30.0
        self.rng = rng or random.Random()
        self.synced = threading.Event()  # set by the first listing that succeeded
        self.listings = 0  # listings made (the first one, and after a 410 or an error)
        self._pods: dict[str, PodInfo] = {}
        self._lock = threading.Lock()

    def pods(self) -> list[PodInfo]:
        with self._lock:
            return sorted(self._pods.values(), key=lambda p: (p.namespace, p.name))

    def start(self, stop: threading.Event) -> threading.Thread:
        t = threading.Thread(target=self.run, args=(stop,), name="dlo-agent-pods", daemon=True)
        t.start()
        return t

    def run(self, stop: threading.Event) -> None:
        """List, then follow the watch until `stop`; after an error, list again (backing off)."""
        from kubernetes.client.exceptions import ApiException

        backoff = 1.0
        while not stop.is_set():
            try:
                version = self._list()
                backoff = 1.0
                while not stop.is_set():
                    version = self._follow(version)
            except ApiException as e:
                if e.status == 410:
                    log.info("pod watch expired (410 Gone): listing again")
                    continue
                log.warning("pod watch failed status=%s error=%s", e.status, e.reason)
            except Exception as e:  # connection lost, API down: keep the last state, back off
                log.warning("pod watch failed error=%s", e)
            stop.wait(backoff * self.rng.uniform(0.5, 1.0))
            backoff = min(backoff * 2, self.max_backoff_s)

    def _list(self) -> str:
        pods, version = self.source.list_pods()
        with self._lock:
            self._pods = {p.uid: p for p in pods}
        self.listings += 1
        self.synced.set()
        return version

    def _follow(self, version: str) -> str:
        """One watch from `version`; the last resourceVersion it reported (a watch that went silent
        past the read timeout is resumed from it, as one the server ended)."""
        seconds = self.watch_seconds * self.rng.uniform(1.0, 1.1)
        try:
            for kind, obj in self.source.watch_pods(version, seconds, self.read_timeout_s):
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind != "BOOKMARK":
                    self._apply(kind, obj)
        except ReadTimeoutError:
            log.debug("pod watch silent for %.0f s: resuming", self.read_timeout_s)
        return version

    def _apply(self, kind: str, obj: dict[str, Any]) -> None:
        uid = str((obj.get("metadata") or {}).get("uid", ""))
        info = self.source.pod_info(obj)
        with self._lock:
            if kind == "DELETED" or info is None:
                self._pods.pop(uid, None)
            else:
                self._pods[uid] = info
