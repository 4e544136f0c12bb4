"""What devices this host has, from the engine's own view: the kind `--device auto` means, how many,
their model and memory, and how they are linked.

Owns: `detect_device`, `resolve_device` (a `--device` value made concrete), `device_count`,
`visible_devices` (the count, or why this process sees none of the kind asked),
`DeviceFacts` / `device_facts` (torch, and NVML for NVLink: what `dlo serve --mode auto` builds its
local node profile from).
Must never: allocate on a device or initialise a process group (`dlo.engine.platform` runs things).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, get_args

import torch

from dlo.plan.errors import ConfigError
from dlo.plan.facts import DeviceKind, InterconnectKind, Vendor


def detect_device() -> DeviceKind:
    """`--device auto`: cuda, else npu, else cpu."""
    if torch.cuda.is_available():
        return "cuda"
    try:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():  # type: ignore[attr-defined]
            return "npu"
    except ImportError:
        pass
    return "cpu"


@dataclass(frozen=True)
class DeviceFacts:
    """What this host's devices are, from the engine's own view (torch, and NVML for NVLink)."""

    vendor: Vendor
    model: str = ""
    count: int = 0
    memory_bytes: int = 0  # of one device
    interconnect: InterconnectKind = "none"
    host_memory_bytes: int = 0


def device_facts(kind: str) -> DeviceFacts:
    """The devices of kind `kind` (cpu: none) and the host's memory, for `--mode auto`'s profile."""
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        host = 0
    count = device_count(kind) if kind != "cpu" else 0
    if count == 0:
        return DeviceFacts("none", host_memory_bytes=host)
    mod = torch.cuda if kind == "cuda" else torch.npu  # type: ignore[attr-defined]
    model = str(mod.get_device_name(0))
    memory = int(mod.get_device_properties(0).total_memory)
    link: InterconnectKind = "pcie" if count > 1 else "none"
    if kind == "cuda":
        return DeviceFacts("nvidia", model, count, memory, "nvlink" if _nvlink() else link, host)
    return DeviceFacts("ascend", model, count, memory, "hccs" if "910" in model and count > 1 else link, host)


def _nvlink() -> bool:
    """Whether device 0 has an active NVLink (NVML; False when NVML is unavailable)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED:
                    return True
            except pynvml.NVMLError:
                return False
        return False
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def resolve_device(device: str) -> DeviceKind:
    """A `--device` value made concrete: `auto` becomes `detect_device()`; anything but a device kind
    is a `ValueError`."""
    if device == "auto":
        return detect_device()
    for kind in get_args(DeviceKind):
        if device == kind:
            return kind
    raise ValueError(f"--device must be one of auto, {', '.join(get_args(DeviceKind))}; got {device!r}")


_VISIBLE_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def visible_devices(kind: str, environ: Mapping[str, str]) -> int:
    """How many devices of `kind` (cuda, npu) this process sees; `ConfigError` naming why when it
    sees none (no device or driver, the devices hidden by *_VISIBLE_DEVICES in `environ`, no torch_npu)."""
    if kind == "npu":
        try:
            import torch_npu  # noqa: F401
        except ImportError:
            raise ConfigError("--device npu: no npu device is visible: torch_npu is not installed") from None
    count = device_count(kind)
    if count == 0:
        env = _VISIBLE_ENV.get(kind, "")
        hidden = f"; {env}={environ[env]!r}" if env in environ else ""
        raise ConfigError(f"--device {kind}: no {kind} device is visible to this process "
                          f"(torch.{kind}.device_count() is 0{hidden}); use --device cpu or auto")
    return count


def device_count(kind: str) -> int:
    if kind == "cuda":
        return torch.cuda.device_count()
    if kind == "npu":
        return torch.npu.device_count()  # type: ignore[attr-defined]
    return 1
