"""The agent's Prometheus collector: every agent metric of docs/contracts.md section 5, at scrape time.

Owns: the metric names, help texts, labels and units of the agent table (a contract; plus
`dlo_model_transformer_bytes`, see [Note: model bytes], and `dlo_model_error`, see
[Note: broken models]), which pods
get per-pod series (DLO pods only in a cluster, every pod by UID outside one), and the registry
the HTTP server exposes (`make_registry`).
Must never: import torch, keep state between scrapes (the node agent, `dlo.agent.node`, owns the
sources and their caches), or let one failing source fail the scrape (an engine that cannot be
scraped in time is logged, counted in `dlo_agent_engine_scrapes_skipped_total{reason}` and its
series are left out; an unknown value is left out, never reported as 0).
"""

from __future__ import annotations

import logging
from typing import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from dlo.agent.memory import CGROUP_KINDS, NODE_KINDS, MemorySnapshot
from dlo.agent.modelcheck import REASONS
from dlo.agent.node import Agent
from dlo.agent.pods import EngineTarget, PodInfo
from dlo.agent.topology import ModelFolder, can_register_page_cache

log = logging.getLogger(__name__)

# pod cgroup kinds exported (the contract's six, plus the peak where the kernel reports one)
POD_CGROUP_KINDS = ("usage", "peak", "anon", "file", "shmem", "file_mapped", "kernel")
assert set(POD_CGROUP_KINDS) <= set(CGROUP_KINDS)


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
        yield from self._pinned(a.engine_targets(pods))
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

    def _pinned(self, targets: list[EngineTarget]) -> Iterable[Metric]:
        fam = GaugeMetricFamily(
            "dlo_pod_host_pinned_bytes",
            "host memory the pod's engine made DMA-able (scraped from dlo_host_pinned_bytes)",
            labels=["namespace", "pod", "source"],
        )
        for t, pinned in self.agent.scrape_engines(targets):
            for source, value in sorted(pinned.items()):
                fam.add_metric([t.namespace, t.pod, source], value)
        yield fam
        skipped = CounterMetricFamily(
            "dlo_agent_engine_scrapes_skipped",
            "engine /metrics scrapes left out: late past the scrape deadline, too large, or failing",
            labels=["reason"],
        )
        for reason, n in sorted(self.agent.scrapes_skipped.items()):
            skipped.add_metric([reason], float(n))
        yield skipped

    def _models(self, models: list[ModelFolder]) -> Iterable[Metric]:
        # [Note: model bytes] Two sizes of one model, never to be confused: dlo_model_bytes is every
        # safetensors file of the folder (transformer, VAE, text encoders: what the page cache and
        # the warmer hold); dlo_model_transformer_bytes is the transformer alone (what the policy
        # and the engine move block by block), the same figure as /profile models[].bytes.
        size = GaugeMetricFamily(
            "dlo_model_bytes",
            "safetensors bytes of every file of the model folder (transformer, VAE, text encoders); "
            "the transformer alone is dlo_model_transformer_bytes",
            labels=["model"],
        )
        transformer = GaugeMetricFamily(
            "dlo_model_transformer_bytes",
            "safetensors bytes of the model's transformer (what is offloaded; /profile models[].bytes)",
            labels=["model"],
        )
        res = GaugeMetricFamily(
            "dlo_model_page_cache_resident_bytes", "bytes of the model's files in the page cache", labels=["model"]
        )
        ratio = GaugeMetricFamily(
            "dlo_model_page_cache_resident_ratio", "page-cache residency of the model's files, 0..1", labels=["model"]
        )
        # [Note: broken models] A folder that cannot be loaded (dlo.agent.modelcheck) has no
        # residency and no transformer size (absent, never 1.0 or 0: its pages are not the model's),
        # and dlo_model_error{reason} is 1 for the reason it is broken. Every folder has one series
        # per reason (0 when not that), as kube-state-metrics does for waiting reasons: the series
        # exist before anything breaks, and a change of reason is a 1 -> 0 and a 0 -> 1.
        error = GaugeMetricFamily(
            "dlo_model_error",
            "1 while the model folder cannot be loaded, for the reason it cannot (truncated, unreadable, "
            "bad_header, bad_index, no_config, missing_shard), else 0; residency is then unknown (absent)",
            labels=["model", "reason"],
        )
        for m in models:
            for reason in REASONS:
                error.add_metric([m.name, reason], 1.0 if m.error is not None and m.error.reason == reason else 0.0)
        for m in models:
            size.add_metric([m.name], float(m.files_bytes))
            if m.facts is not None:
                transformer.add_metric([m.name], float(m.facts.bytes))
            if m.resident_bytes is not None and m.resident_ratio is not None:
                res.add_metric([m.name], float(m.resident_bytes))
                ratio.add_metric([m.name], m.resident_ratio)
        yield from (size, transformer, res, ratio, error)
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
