"""Topology: read this node's accelerators, interconnect, PCIe link, NUMA, RAM and model folders.

Owns: building the `NodeProfile` (dlo.plan.profile) from the host - NVML (nvidia-ml-py) for NVIDIA
devices, `npu-smi info` text for Ascend devices, sysfs for PCIe links and NUMA nodes,
`/proc/meminfo` for RAM - plus the facts of each model folder under a models root
(`dlo.engine.blocks.describe`, page-cache residency). Nominal bandwidths come from
dlo.plan.profile unless a `dlo calibrate` fragment is applied.
Must never: import torch, fail because a device library or tool is missing (no accelerator is a
valid answer), or write to the host.

`can_register_page_cache`: True on NVIDIA (CUDA `cudaHostRegister` with the read-only flag on a
read-only file mapping: measured on an H200, H2D straight from the page cache at 55.4 GB/s);
False on Ascend (pinned memory comes from the NPU driver, it cannot register file pages) and on CPU.
"""

from __future__ import annotations

import logging
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from dlo.agent.memory import ProcFS
from dlo.agent.modelcheck import ModelError, check_folder, describe_error, is_model_folder, scan_error
from dlo.plan.profile import (
    Accelerator,
    Interconnect,
    InterconnectKind,
    ModelErrorProfile,
    ModelProfile,
    NodeProfile,
    PcieLink,
    nominal_collective_bps,
    nominal_h2d_bps,
)
from dlo.pagecache.residency import Residency, ResidencyError, folder_residency, model_files
from dlo.pagecache.tree import walk_files
from dlo.plan.facts import ModelFacts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Devices:
    accelerator: Accelerator
    interconnect_kind: InterconnectKind
    pcie: PcieLink | None
    bus_ids: tuple[str, ...] = ()


NO_DEVICES = Devices(Accelerator(), "none", None)


# --- NVIDIA ----------------------------------------------------------------------------------


def nvidia_devices() -> Devices | None:
    """NVIDIA devices through NVML; None when there is no driver or no device."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        log.debug("nvml unavailable error=%s", e)
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return None
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        name = name.decode() if isinstance(name, bytes) else str(name)
        memory = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
        nvlink = False
        for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED:
                    nvlink = True
                    break
            except pynvml.NVMLError:
                break
        pcie = None
        try:
            pcie = PcieLink(
                generation=int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)),
                width=int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)),
            )
        except pynvml.NVMLError:
            pass
        kind: InterconnectKind = "nvlink" if nvlink else ("pcie" if count > 1 else "none")
        return Devices(Accelerator(vendor="nvidia", model=name, count=count, memory_bytes=memory), kind, pcie)
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


# --- Ascend ----------------------------------------------------------------------------------

# `npu-smi info`: per chip two rows, "| NPU Name | Health | ..." then "| Chip [Phy-ID] | Bus-Id |
# AICore Memory-Usage HBM-Usage |"; the process table after the chips is ignored.
_NPU_ROW = re.compile(r"^\|\s*(\d+)\s+(\S+)\s*\|\s*(\S+)\s*\|")
_CHIP_ROW = re.compile(
    r"^\|\s*(\d+)(?:\s+\d+)?\s*\|\s*([0-9A-Fa-fx]{4,8}:[0-9A-Fa-fx]{2}:[0-9A-Fa-fx]{2}\.[0-9A-Fa-f])\s*\|"
    r".*?(\d+)\s*/\s*(\d+)\s*\|\s*$"
)


class NpuSmiParseError(ValueError):
    pass


@dataclass(frozen=True)
class NpuChip:
    npu: int
    chip: int
    name: str
    health: str
    bus_id: str
    hbm_used_mb: int
    hbm_total_mb: int


def parse_npu_smi_info(text: str) -> list[NpuChip]:
    """Chips listed by `npu-smi info` (one entry per chip: what torch_npu sees as a device)."""
    chips: list[NpuChip] = []
    pending: tuple[int, str, str] | None = None
    for line in text.splitlines():
        if "Process id" in line or "Process name" in line:
            break
        if pending is None:
            m = _NPU_ROW.match(line)
            if m and not line.lstrip("| ").startswith("NPU"):
                pending = (int(m.group(1)), m.group(2), m.group(3))
            continue
        c = _CHIP_ROW.match(line)
        if c:
            npu, name, health = pending
            chips.append(NpuChip(npu, int(c.group(1)), name, health, c.group(2), int(c.group(3)), int(c.group(4))))
        pending = None
    if not chips and "npu-smi" in text:
        raise NpuSmiParseError("npu-smi info printed no chip rows this parser understands")
    return chips


def parse_npu_smi_topo(text: str) -> InterconnectKind:
    """Interconnect from `npu-smi info -t topo`: HCCS when chips link through it, else PCIe."""
    body = text.split("Legend", 1)[0]
    if "HCCS" in body:
        return "hccs"
    if re.search(r"\b(PIX|PXB|PHB|SYS|NODE)\b", body):
        return "pcie"
    return "none"


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("command failed argv=%s error=%s", argv, e)
        return None


def ascend_devices(sys_root: Path = Path("/sys")) -> Devices | None:
    info = _run(["npu-smi", "info"])
    if info is None:
        return None
    try:
        chips = parse_npu_smi_info(info)
    except NpuSmiParseError as e:
        log.warning("npu-smi output not understood error=%s", e)
        return None
    if not chips:
        return None
    kind: InterconnectKind = parse_npu_smi_topo(_run(["npu-smi", "info", "-t", "topo"]) or "")
    if kind == "none" and len(chips) > 1:
        kind = "pcie"
    acc = Accelerator(vendor="ascend", model=chips[0].name, count=len(chips), memory_bytes=chips[0].hbm_total_mb << 20)
    bus_ids = tuple(c.bus_id for c in chips)
    return Devices(acc, kind, pcie_link(sys_root, bus_ids[0]), bus_ids)


# --- sysfs -----------------------------------------------------------------------------------

_GTS_TO_GEN = {"2.5": 1, "5.0": 2, "8.0": 3, "16.0": 4, "32.0": 5, "64.0": 6}


def pcie_link(sys_root: Path, bus_id: str) -> PcieLink | None:
    """Current PCIe link of a device from sysfs (`current_link_speed`, `current_link_width`)."""
    d = Path(sys_root) / "bus" / "pci" / "devices" / bus_id.lower()
    try:
        speed = (d / "current_link_speed").read_text().split()[0]
        width = int((d / "current_link_width").read_text().strip())
    except (OSError, ValueError, IndexError):
        return None
    return PcieLink(generation=_GTS_TO_GEN.get(speed), width=width)


def numa_nodes(sys_root: Path = Path("/sys")) -> int:
    d = Path(sys_root) / "devices" / "system" / "node"
    try:
        n = sum(1 for p in d.iterdir() if re.fullmatch(r"node\d+", p.name))
    except OSError:
        return 1
    return max(n, 1)


# --- models ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFolder:
    """A model folder under the models root: its files on disk, its transformer's facts, and why it
    cannot be loaded when it cannot (`error`, dlo.agent.modelcheck)."""

    name: str
    path: Path
    files_bytes: int  # every safetensors file of the folder (transformer, VAE, text encoders)
    resident_bytes: int | None  # of those files, in the page cache; None: unknown
    facts: ModelFacts | None  # the transformer's facts; None when the folder has none we know
    error: ModelError | None = None  # set while the folder is broken (truncated, unreadable, ...)

    @property
    def resident_ratio(self) -> float | None:
        """Page-cache residency of the folder's files, 0..1; None: unknown, as for a broken folder
        (the pages of a truncated file are not the model's: never report it as resident)."""
        if self.resident_bytes is None or self.error is not None:
            return None
        return self.resident_bytes / self.files_bytes if self.files_bytes else 1.0

    def profile_entry(self) -> ModelProfile | None:
        """This folder's entry of `NodeProfile.models` (None without facts, or while broken)."""
        if self.facts is None or self.error is not None:
            return None
        return ModelProfile.of(self.facts, self.resident_ratio)


# folder -> (signature of its files, (error, facts)): headers, indexes and configs are read again only
# when a file changes (name, size, mtime, ctime: a chmod counts); residency is measured on every call.
_CHECK_CACHE: dict[Path, tuple[tuple, tuple[ModelError | None, ModelFacts | None]]] = {}


def _folder_signature(folder: Path) -> tuple:
    sig = []
    for p in sorted(walk_files(folder, (".safetensors", ".json"))):
        if p.is_file():
            st = p.stat()
            sig.append((str(p.relative_to(folder)), st.st_mtime_ns, st.st_ctime_ns, st.st_size, st.st_mode))
    return tuple(sig)


def _check_and_describe(folder: Path) -> tuple[ModelError | None, ModelFacts | None]:
    """(why the folder is broken or None, its transformer's facts or None); cached per signature."""
    from dlo.plan.folder import CheckpointError, describe

    try:
        sig = _folder_signature(folder)
    except OSError as e:
        return ModelError.of("unreadable", f"{folder}: cannot list: {e.strerror or e}"), None
    hit = _CHECK_CACHE.get(folder)
    if hit is not None and hit[0] == sig:
        return hit[1]
    error, facts = check_folder(folder), None
    if error is None:
        try:
            facts = describe(folder)
        except KeyError as e:  # a model class without a DLO family: not ours to load, not broken
            log.info("no model facts model=%s reason=%s", folder.name, e)
        except CheckpointError as e:
            if e.path.endswith("config.json"):  # a config that is not a diffusers model's: as above
                log.info("no model facts model=%s reason=%s", folder.name, e)
            else:
                error = describe_error(folder, e)
        except OSError as e:
            error = ModelError.of("unreadable", e)
    _CHECK_CACHE[folder] = (sig, (error, facts))
    return error, facts


def model_folders(models_root: Path | None) -> list[ModelFolder]:
    """Every model folder directly under `models_root`, with its facts and residency, or why it is
    broken (`ModelFolder.error`). Logs nothing per folder: the node agent logs each change of state."""
    if models_root is None:
        return []
    try:
        # hidden folders are no models: a fetch's staging folder (`.<name>.partial`), an eviction
        folders = sorted(p for p in Path(models_root).iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError as e:
        log.warning("models root unreadable path=%s error=%s", models_root, e)
        return []
    out: list[ModelFolder] = []
    for folder in folders:
        try:
            found = _scan_folder(folder)
        except Exception as e:  # one folder's scan failing flags that folder, never the whole scan
            found = ModelFolder(folder.name, folder, 0, None, None, scan_error(folder, e))
        if found is not None:
            out.append(found)
    return out


def _scan_folder(folder: Path) -> ModelFolder | None:
    """One folder of the models root (None: not a model folder)."""
    try:
        if not is_model_folder(folder):
            return None
    except OSError as e:
        return ModelFolder(folder.name, folder, 0, None, None,
                           ModelError.of("unreadable", f"{folder}: cannot list: {e.strerror or e}"))
    error, facts = _check_and_describe(folder)
    res: Residency | None = None
    if error is None:  # a broken folder's residency is unknown whatever its pages: not measured
        try:
            res = folder_residency(folder)
        except (ResidencyError, FileNotFoundError) as e:
            error = ModelError.of("unreadable", e)
    if res is None:
        try:
            files_bytes = sum(f.stat().st_size for f in model_files(folder))
        except OSError:
            files_bytes = 0
    else:
        files_bytes = res.bytes
    return ModelFolder(name=folder.name, path=folder, files_bytes=files_bytes,
                       resident_bytes=res.resident_bytes if res else None,
                       facts=None if error is not None else facts, error=error)


# --- the profile -----------------------------------------------------------------------------


def can_register_page_cache(vendor: str) -> bool:
    """Whether the engine can DMA from the page cache itself (module docstring)."""
    return vendor == "nvidia"


def detect_devices(sys_root: Path = Path("/sys")) -> Devices:
    return nvidia_devices() or ascend_devices(sys_root) or NO_DEVICES


def build_profile(
    node: str,
    devices: Devices,
    *,
    proc: ProcFS,
    sys_root: Path = Path("/sys"),
    models: list[ModelFolder] = (),  # type: ignore[assignment]
) -> NodeProfile:
    """The node profile with nominal bandwidths (apply a calibration fragment on top)."""
    acc = devices.accelerator
    if acc.vendor == "none":
        h2d, coll = 0, 0
    else:
        h2d = nominal_h2d_bps(acc.model)
        gen = devices.pcie.generation if devices.pcie else None
        coll = nominal_collective_bps(acc.model, devices.interconnect_kind, gen)
    return NodeProfile(
        node=node,
        accelerator=acc,
        interconnect=Interconnect(kind=devices.interconnect_kind, collective_bandwidth_bps=coll),
        pcie=devices.pcie,
        h2d_bandwidth_bps=h2d,
        host_memory_bytes=proc.meminfo().get("MemTotal", 0),
        numa_nodes=numa_nodes(sys_root),
        can_register_page_cache=can_register_page_cache(acc.vendor),
        measured=False,
        models={m.name: e for m in models if (e := m.profile_entry()) is not None},
        model_errors={
            m.name: ModelErrorProfile(reason=m.error.reason, message=m.error.message) for m in models if m.error
        } or None,
    )


def local_profile() -> NodeProfile:
    """This machine's profile (devices, host memory, nominal bandwidths), as `dlo plan` and the
    engine's `--mode auto` see it without an agent."""
    return build_profile(socket.gethostname(), detect_devices(), proc=ProcFS(Path("/proc")))
