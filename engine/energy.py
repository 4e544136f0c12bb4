"""Device energy from NVML's counter: what a rank and a benchmark report as joules.

Owns: `EnergyMeter` (NVML's `nvmlDeviceGetTotalEnergyConsumption`, millijoules since the driver
loaded, per GPU, read as joules since the meter started) and `rank_meter` (the meter of a rank's
own device, found by UUID so CUDA_VISIBLE_DEVICES and CUDA's device order cannot point it at
another GPU). Where the counter is missing (no NVML, not an NVIDIA GPU, a GPU older than Volta, a
driver that answers NOT_SUPPORTED) a meter is None or a reading is None: never 0, which would read
as "used no energy".
Must never: import torch or pynvml at import time, or raise on a host without NVML.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class EnergyMeter:
    """Joules the given GPUs used since the meter started (NVML handles, one per GPU)."""

    def __init__(self, nvml: Any, handles: list[Any]):
        self._nvml, self._handles = nvml, handles
        self._start = self._read()

    @classmethod
    def all_gpus(cls) -> "EnergyMeter | None":
        """Every GPU NVML sees (the benchmark's whole node); None without a counter."""
        nvml = _nvml()
        if nvml is None:
            return None
        try:
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            return cls._checked(nvml, handles)
        except nvml.NVMLError as e:
            log.info("no device energy counter: %s", e)
            return None

    @classmethod
    def _checked(cls, nvml: Any, handles: list[Any]) -> "EnergyMeter | None":
        if not handles:
            return None
        try:
            return cls(nvml, handles)
        except nvml.NVMLError as e:  # NOT_SUPPORTED on this GPU or driver
            log.info("no device energy counter: %s", e)
            return None

    def _read(self) -> list[float]:
        return [self._nvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000.0 for h in self._handles]

    def per_gpu(self) -> list[float] | None:
        """Joules per GPU since the meter started; None when a reading fails."""
        try:
            return [now - start for now, start in zip(self._read(), self._start)]
        except self._nvml.NVMLError as e:
            log.warning("device energy counter unreadable: %s", e)
            return None

    def joules(self) -> float | None:
        """Joules of all its GPUs together since the meter started."""
        per = self.per_gpu()
        return None if per is None else sum(per)


def rank_meter(device: Any) -> EnergyMeter | None:
    """The meter of one rank's device (a `torch.device`); None off CUDA or without a counter."""
    if getattr(device, "type", None) != "cuda":
        return None
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        import torch

        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        return EnergyMeter._checked(nvml, [nvml.nvmlDeviceGetHandleByUUID(("GPU-" + uuid).encode())])
    except (nvml.NVMLError, AttributeError, RuntimeError) as e:
        log.info("no device energy counter for %s: %s", device, e)
        return None


def _nvml() -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception as e:  # ImportError, or NVMLError_LibraryNotFound / DriverNotLoaded (any NVMLError)
        log.info("NVML unavailable: %s", e)
        return None
