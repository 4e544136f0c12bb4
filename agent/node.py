"""The node agent's state and background loops: what one scrape or one publish reads.

Owns: `AgentConfig` (what `dlo agent` was started with), `Agent` (the sources every scrape and
`/profile` read: memory snapshot, model folders scanned by the node loop every `models_ttl_s`, pods
from their source (in a cluster a watch, `dlo.agent.podwatch`; another source is asked at most every
`pods_ttl_s`) and kept through API outages, the `NodeProfile` with the
calibration applied, the engines to scrape and `scrape_engines`: every engine at once, each within
the scrape deadline and byte bound of `dlo.agent.pods`, one that is late skipped and counted by
reason in `scrapes_skipped`), the log of broken model folders (one WARNING per change
of state), agent-side warming with its per-model records, and the loops `dlo agent` runs in threads:
`model_loop` (scan the model folders: facts, residency, broken files), `publish_loop` (patch the node
annotation when the published profile changes: residency in bands, `band_residency`) and `warm_loop`.
Must never: import torch, wait on one engine past the scrape deadline (nor on engines one after
another), write anything on the host but the page cache it warms, let an API
error or one unreadable source end a loop (it is logged and the next round retries), or scan the
models root on a scrape while `model_loop` runs (a scan reads every header and measures every
file's residency: with many or huge files it takes longer than a scrape may).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dlo.agent.memory import CgroupFS, MemorySnapshot, ProcFS, snapshot
from dlo.agent.modelcheck import ModelError
from dlo.agent.pods import SCRAPE_TIMEOUT_S, EngineTarget, PodInfo, PodSource, ScrapeSkipped, engine_targets, \
    scrape_pinned
from dlo.plan.profile import CalibrationFragment, NodeProfile, apply_calibration, parse_file
from dlo.agent.topology import Devices, ModelFolder, build_profile, detect_devices, model_folders
from dlo.pagecache.warm import warm

log = logging.getLogger(__name__)

SCRAPE_WORKERS = 16  # engines scraped at once (a node runs a handful)
SCRAPE_SLACK_S = 0.5  # beyond the scrape deadline: a late engine's thread ends at its own deadline


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
    """State behind `/metrics` and `/profile`: one memory scan per scrape, model folders cached for
    `models_ttl_s`, pods for `pods_ttl_s`."""

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
        self._lock = threading.Lock()  # guards the last scan (a swap, never held during a scan)
        self._scan_lock = threading.Lock()  # one scan at a time (node loop, warming)
        self._model_loop = False
        self.models_scanned = threading.Event()  # set once the first scan round ended (well or not)
        self.model_errors: dict[str, ModelError] = {}  # broken folders of the last scan
        self.scrapes_skipped: Counter[str] = Counter()  # engine scrapes skipped, by reason
        self._scrape_pool = ThreadPoolExecutor(SCRAPE_WORKERS, thread_name_prefix="dlo-agent-scrape")

    @staticmethod
    def _load_calibration(path: Path | None) -> CalibrationFragment | None:
        if path is None:
            return None
        try:
            return parse_file(CalibrationFragment, Path(path).read_text(), str(path))
        except (OSError, ValueError) as e:
            raise ValueError(f"not a usable calibration fragment: {e}") from e

    # -- sources ------------------------------------------------------------------------------

    def models(self, fresh: bool = False) -> list[ModelFolder]:
        """The model folders of the last scan. While `model_loop` runs, this never scans (before its
        first scan finishes there are none: their series are absent, not 0); without the loop
        (library use) a missing or stale scan is made here. `fresh`: scan now, whatever."""
        if fresh:
            return self.scan_models()
        with self._lock:
            last, looping = self._models, self._model_loop
        if last is not None and (looping or time.monotonic() - last[0] <= self.cfg.models_ttl_s):
            return last[1]
        return [] if looping else self.scan_models()

    def scan_models(self) -> list[ModelFolder]:
        """Scan the models root (facts, residency, broken files), keep the result, log changes."""
        with self._scan_lock:
            try:
                folders = model_folders(self.cfg.models_root)
                self._note_errors(folders)
                with self._lock:
                    self._models = (time.monotonic(), folders)
            finally:  # a round that failed is a round too: what waits for the first one goes on
                self.models_scanned.set()
        return folders

    def _note_errors(self, folders: list[ModelFolder]) -> None:
        """One log line per change of state of a folder (broken, reason changed, repaired), never
        one per scan."""
        now = {m.name: m.error for m in folders if m.error is not None}
        for name, err in sorted(now.items()):
            before = self.model_errors.get(name)
            if before is None or before.reason != err.reason:
                log.warning("model broken model=%s reason=%s error=%s", name, err.reason, err.message)
        present = {m.name for m in folders}
        for name in sorted(self.model_errors.keys() - now.keys()):
            log.info("model %s model=%s", "no longer broken" if name in present else "folder removed", name)
        self.model_errors = now

    @property
    def model_loop_running(self) -> bool:
        return self._model_loop

    def start_model_loop(self, stop: threading.Event) -> threading.Thread:
        """Run `model_loop` in a daemon thread; from now on scrapes only read its last scan."""
        with self._lock:
            self._model_loop = True
        t = threading.Thread(target=model_loop, args=(self, stop, self.cfg.models_ttl_s),
                             name="dlo-agent-models", daemon=True)
        t.start()
        return t

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
        return engine_targets(self.cfg.engine_urls, pods)

    def scrape_engines(self, targets: list[EngineTarget]) -> list[tuple[EngineTarget, dict[str, float]]]:
        """Every target's `dlo_host_pinned_bytes` by source, scraped at once: the whole call takes at
        most the scrape deadline (and a little slack); a target that is late, too large or failing is
        left out, logged and counted in `scrapes_skipped`."""
        futures = {self._scrape_pool.submit(scrape_pinned, t.url): t for t in targets}
        _, late = wait(futures, timeout=SCRAPE_TIMEOUT_S + SCRAPE_SLACK_S)
        out = []
        for fut, t in futures.items():
            try:
                if fut in late:
                    fut.cancel()
                    raise ScrapeSkipped("timeout", f"{t.url}/metrics did not answer within {SCRAPE_TIMEOUT_S:g} s")
                out.append((t, fut.result()))
            except ScrapeSkipped as e:
                self.scrapes_skipped[e.reason] += 1
                log.warning("engine scrape skipped url=%s reason=%s error=%s", t.url, e.reason, e)
        return out

    def memory(self) -> MemorySnapshot:
        return snapshot(self.proc, self.cgroups)

    # -- warming ------------------------------------------------------------------------------

    def warm_models(self) -> None:
        """Warm every model folder whose residency is below the threshold; record the outcome."""
        for m in self.models(fresh=True):
            if m.error is not None:
                continue  # warming a truncated or unreadable folder cannot help (it is logged as broken)
            ratio = m.resident_ratio if m.files_bytes and m.resident_ratio is not None else 0.0
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


def model_loop(agent: Agent, stop: threading.Event, interval_s: float) -> None:
    """Scan the model folders every `interval_s` (the node loop behind every scrape's model series)."""
    while not stop.is_set():
        try:
            agent.scan_models()
        except Exception as e:  # a scan that fails keeps the last one; the next round retries
            log.warning("model scan failed error=%s", e)
        stop.wait(interval_s)


# [Note: residency bands] A node's profile is patched only when it changes, and the page-cache
# residency of its models moves with every page read or evicted: published as measured, each move
# would patch the node (and wake the DLODeployments whose pods run there). The annotation carries the
# residency floored to a band instead: whole percent below 99 %, a tenth of a percent from 99 % (where
# warm thresholds sit), 1.0 only when every page is resident. Floored, it never says more is resident
# than is; `/profile` and `dlo_model_page_cache_resident_ratio` give the measured value.
FINE_BAND_FROM = 990  # thousandths: from 99.0 % the band is 0.1 %, below it 1 %


def band_residency(ratio: float | None) -> float | None:
    """`ratio` floored to its band (see [Note: residency bands]); None stays None."""
    if ratio is None or ratio >= 1.0:
        return ratio
    thousandths = max(0, math.floor(ratio * 1000 + 1e-9))
    if thousandths < FINE_BAND_FROM:
        thousandths -= thousandths % 10
    return min(thousandths, 999) / 1000


def published_profile(profile: NodeProfile) -> NodeProfile:
    """The profile as the node annotation carries it: residency in bands."""
    models = {name: m.model_copy(update={"resident_ratio": band_residency(m.resident_ratio)})
              for name, m in profile.models.items()}
    return profile.model_copy(update={"models": models})


def publish_loop(agent: Agent, annotate: Callable[[str], None], stop: threading.Event, interval_s: float) -> None:
    """Patch the node annotation when the published profile changes (checked every `interval_s`:
    at most one patch per interval, none while the residency stays in its band)."""
    last = None
    # With the node loop on, publish once its first scan round ended (its models, or none if it
    # failed: a node without a scan still publishes its devices), not before.
    while agent.model_loop_running and not agent.models_scanned.wait(1.0) and not stop.is_set():
        pass
    while not stop.is_set():
        try:
            value = published_profile(agent.profile()).to_annotation()
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
