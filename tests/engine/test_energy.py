"""Device energy: NVML's counter read as joules since a meter started (a stand-in for the NVML
library, which this host has no GPU for), None where there is no counter, and the engine's
`dlo_device_energy_joules_total{rank}` series only for ranks whose device counts."""

from __future__ import annotations

import pytest

from dlo.engine.energy import EnergyMeter, rank_meter


class FakeNvml:
    """The three NVML calls the meter makes, over per-GPU millijoule counters."""

    class NVMLError(Exception):
        pass

    def __init__(self, counters: list[int], supported: bool = True):
        self.counters, self.supported = counters, supported

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: int) -> int:
        if not self.supported:
            raise self.NVMLError("Not Supported")
        return self.counters[handle]


def test_meter_counts_joules_per_gpu_since_it_started() -> None:
    nvml = FakeNvml([5_000_000, 9_000_000])
    meter = EnergyMeter._checked(nvml, [0, 1])
    assert meter is not None and meter.per_gpu() == [0.0, 0.0]
    nvml.counters = [5_250_000, 9_500_500]
    assert meter.per_gpu() == [250.0, 500.5] and meter.joules() == 750.5
    nvml.supported = False
    assert meter.per_gpu() is None and meter.joules() is None  # unreadable: None, never 0


def test_no_counter_no_meter() -> None:
    import torch

    assert EnergyMeter._checked(FakeNvml([1], supported=False), [0]) is None
    assert EnergyMeter._checked(FakeNvml([]), []) is None
    assert rank_meter(torch.device("cpu")) is None


@pytest.mark.parametrize("joules", [12.5, None])
def test_energy_metric_only_for_ranks_with_a_counter(joules) -> None:
    from dlo.serving.metrics import EngineMetrics

    stats = {"gathers": 1, "h2d_bytes": 2, "collective_bytes": 0, "gather_wait_seconds": 0.0,
             "device_memory_peak_bytes": 0, "device_energy_joules": joules}
    text = EngineMetrics(2, lambda: {0: {"report": {}, "stats": stats}, 1: {"report": {}, "stats": {}}}) \
        .exposition().decode()
    lines = [line for line in text.splitlines() if line.startswith("dlo_device_energy_joules_total")]
    assert lines == ([f'dlo_device_energy_joules_total{{rank="0"}} {joules}'] if joules is not None else [])
    assert "# TYPE dlo_device_energy_joules_total counter" in text
