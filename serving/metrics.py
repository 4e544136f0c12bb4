"""Prometheus metrics of `dlo serve` (docs/contracts.md section 5, engine table; names are a contract).

Owns: one registry per server; request/wave/step and video-job metrics updated by rank 0 (the jobs
by state are read from the store at scrape time), and per-rank weight metrics collected at scrape
time from the latest stats every rank reported (rank 0 serves them all).
Must never: invent metric names outside the contract table, or label by request (cardinality) or by
anything a client chooses (a tenant label is a name of the keys given at start, never a key).
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dlo.plan.facts import Mode

# `_created` series double the exposition and no dashboard reads them.
disable_created_metrics()

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
STEP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _RankCollector(Collector):
    """Per-rank weight metrics, from `rank_facts()`: {rank: {"report": LoadReport dict, "stats": {...}}}."""

    def __init__(self, rank_facts: Callable[[], dict[int, dict]]):
        self.rank_facts = rank_facts

    def collect(self) -> Iterable[Metric]:
        facts = self.rank_facts()
        wait = CounterMetricFamily("dlo_gather_wait_seconds", "compute time spent waiting for weights", labels=["rank"])
        h2d = CounterMetricFamily("dlo_h2d_bytes", "host-to-device weight bytes", labels=["rank"])
        coll = CounterMetricFamily("dlo_collective_bytes", "bytes received by weight gathers", labels=["rank"])
        skipped = CounterMetricFamily("dlo_cache_block_calls_skipped", "transformer block calls a request's step "
                                      "cache skipped on this rank", labels=["rank"])
        unstreamed = CounterMetricFamily("dlo_cache_bytes_not_streamed", "weight bytes this rank did not move because "
                                         "no rank of its shard group ran the block (a step cache skipped it)",
                                         labels=["rank"])
        pinned = GaugeMetricFamily(
            "dlo_host_pinned_bytes",
            "host memory made DMA-able by this rank; shared=\"true\": the registered page cache, the same "
            "pages for every rank of the pod (count once per pod: max over ranks); shared=\"false\": the "
            "rank's own arena (sum over ranks)",
            labels=["rank", "source", "shared"])
        slot = GaugeMetricFamily("dlo_device_slot_bytes", "the two device slots", labels=["rank"])
        resident = GaugeMetricFamily("dlo_device_resident_bytes", "non-block and resident-block weights on the device",
                                     labels=["rank"])
        peak = GaugeMetricFamily("dlo_device_memory_peak_bytes", "device allocator peak", labels=["rank"])
        energy = CounterMetricFamily("dlo_device_energy_joules", "energy the rank's device used since the rank "
                                     "started (NVML); no series where the device has no counter", labels=["rank"])
        for rank, f in sorted(facts.items()):
            r = str(rank)
            report, stats = f.get("report") or {}, f.get("stats") or {}
            wait.add_metric([r], float(stats.get("gather_wait_seconds", 0.0)))
            h2d.add_metric([r], float(stats.get("h2d_bytes", 0)))
            coll.add_metric([r], float(stats.get("collective_bytes", 0)))
            skipped.add_metric([r], float(stats.get("block_calls_skipped", 0)))
            unstreamed.add_metric([r], float(stats.get("bytes_not_streamed", 0)))
            source = report.get("weights_source", "arena")
            if source in ("arena", "registered"):
                shared = "true" if source == "registered" else "false"
                pinned.add_metric([r, source, shared], float(report.get("host_pinned_bytes", 0)))
            slot.add_metric([r], float(report.get("slot_bytes", 0)))
            resident.add_metric([r], float(report.get("resident_bytes", 0)))
            peak.add_metric([r], float(stats.get("device_memory_peak_bytes", 0)))
            if stats.get("device_energy_joules") is not None:
                energy.add_metric([r], float(stats["device_energy_joules"]))
        yield from (wait, h2d, coll, skipped, unstreamed, pinned, slot, resident, peak, energy)


VIDEO_JOB_BUCKETS = (1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)
VIDEO_STATES = ("queued", "in_progress", "completed", "failed")


class _VideoJobsCollector(Collector):
    """`dlo_video_jobs{state}`: this pod's jobs per state, read from the store at scrape time."""

    def __init__(self) -> None:
        self.source: Callable[[], dict[str, int]] = lambda: {}

    def collect(self) -> Iterable[Metric]:
        fam = GaugeMetricFamily("dlo_video_jobs", "this pod's video jobs by state", labels=["state"])
        counts = self.source()
        for state in VIDEO_STATES:
            fam.add_metric([state], float(counts.get(state, 0)))
        yield fam


class EngineMetrics:
    def __init__(self, dp: int, rank_facts: Callable[[], dict[int, dict]]):
        self.registry = CollectorRegistry()
        reg = self.registry
        self.info = Gauge("dlo_engine_info", "what runs", ["mode", "dp", "family", "device", "weights_source"],
                          registry=reg)
        self.ready = Gauge("dlo_ready", "1 when /ready would answer 200", registry=reg)
        # `tenant`: the name of the request's key (--api-keys; "default" for a single key), empty without
        # one; the names come from the keys given at start only, so the label stays bounded
        self.requests = Counter("dlo_requests", "requests answered (code 499: the client left before the answer; "
                                "tenant: the name of the request's API key)",
                                ["endpoint", "method", "code", "tenant"], registry=reg)
        self.request_duration = Histogram(
            "dlo_request_duration_seconds", "end-to-end latency of requests answered with their result (POST "
            "/v1/images/generations; a video job is timed by dlo_video_job_duration_seconds)", ["endpoint", "tenant"],
            buckets=LATENCY_BUCKETS, registry=reg)
        self.queue_depth = Gauge("dlo_queue_depth", "requests waiting for a wave", registry=reg)
        self.requests_running = Gauge("dlo_requests_running", "requests in the wave running on the ranks", registry=reg)
        self.video_job_duration = Histogram("dlo_video_job_duration_seconds",
                                            "a video job from its creation to its completion",
                                            buckets=VIDEO_JOB_BUCKETS, registry=reg)
        self.video_job_failures = Counter("dlo_video_job_failures", "video jobs that failed, by error code",
                                          ["code"], registry=reg)
        self.vae_tiled = Counter("dlo_vae_tiled", "requests whose decode runs tiled (not the bytes of a plain "
                                 "decode: the plain one does not fit the device budget, or --vae-tiling always)",
                                 ["kind"], registry=reg)
        self._video_jobs = _VideoJobsCollector()
        reg.register(self._video_jobs)
        self.wave_size = Histogram("dlo_wave_size", "requests per wave", buckets=tuple(range(1, dp + 1)), registry=reg)
        self.wave_duration = Histogram("dlo_wave_duration_seconds", "wave wall time", buckets=LATENCY_BUCKETS,
                                       registry=reg)
        self.step_duration = Histogram("dlo_step_duration_seconds", "one denoising step", buckets=STEP_BUCKETS,
                                       registry=reg)
        reg.register(_RankCollector(rank_facts))

    def mean_wave_seconds(self) -> float:
        """The mean wave time so far (1 s before the first wave)."""
        count = total = 0.0
        for metric in self.wave_duration.collect():
            for sample in metric.samples:
                if sample.name.endswith("_count"):
                    count = sample.value
                elif sample.name.endswith("_sum"):
                    total = sample.value
        return total / count if count else 1.0

    def video_jobs_source(self, source: Callable[[], dict[str, int]]) -> None:
        """Where `dlo_video_jobs{state}` reads this pod's jobs per state."""
        self._video_jobs.source = source

    def set_info(self, mode: Mode, dp: int, family: str, device: str, weights_source: str) -> None:
        self.info.clear()
        self.info.labels(mode, str(dp), family, device, weights_source).set(1)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
