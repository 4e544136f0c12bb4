"""The node agent's state and background loops: what one scrape or one publish reads.

Owns: `AgentConfig` (what `dlo agent` was started with), `Agent` (the sources every scrape and
`/profile` read: memory snapshot, model folders cached for `models_ttl_s`, pods listed at most every
`pods_ttl_s` and kept through API outages, the `NodeProfile` with the calibration applied, the
engines to scrape), agent-side warming with its per-model records, and the two loops `dlo agent`
runs in threads: `publish_loop` (patch the node annotation when the profile changes) and
`warm_loop`.
Must never: import torch, write anything on the host but the page cache it warms, or let an API
error or one unreadable source end a loop (it is logged and the next round retries).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dlo.agent.memory import CgroupFS, MemorySnapshot, ProcFS, snapshot
from dlo.agent.pods import EngineTarget, PodInfo, PodSource, engine_targets
from dlo.agent.profile import CalibrationFragment, NodeProfile, apply_calibration, parse_file
from dlo.agent.topology import Devices, ModelFolder, build_profile, detect_devices, model_folders
from dlo.agent.warm import warm

log = logging.getLogger(__name__)


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
        self._lock = threading.Lock()

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
        return engine_targets(self.cfg.engine_urls, pods)

    def memory(self) -> MemorySnapshot:
        return snapshot(self.proc, self.cgroups)

    # -- warming ------------------------------------------------------------------------------

    def warm_models(self) -> None:
        """Warm every model folder whose residency is below the threshold; record the outcome."""
        for m in self.models(fresh=True):
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
