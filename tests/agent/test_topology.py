"""dlo.agent.topology: npu-smi text, sysfs, NVML absence, model folders, the built profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dlo.agent.memory import ProcFS
from dlo.plan.profile import Accelerator, NodeProfile, PcieLink
from dlo.agent.topology import (
    NO_DEVICES,
    Devices,
    NpuSmiParseError,
    build_profile,
    model_folders,
    numa_nodes,
    nvidia_devices,
    parse_npu_smi_info,
    parse_npu_smi_topo,
    pcie_link,
)
from dlo.engine.blocks import describe

from .conftest import write_wan_folder

SAMPLES = Path(__file__).parent / "fixtures" / "npu-smi"
GiB = 1 << 30


def test_npu_smi_one_chip_per_npu_layout() -> None:
    chips = parse_npu_smi_info((SAMPLES / "info-910b3-8.txt").read_text())
    assert len(chips) == 8
    assert {c.name for c in chips} == {"910B3"}
    assert [c.npu for c in chips] == list(range(8))
    assert chips[0].bus_id == "0000:C1:00.0" and chips[7].bus_id == "0000:42:00.0"
    assert chips[0].hbm_total_mb == 65536 and chips[2].hbm_used_mb == 3163


def test_npu_smi_two_chips_per_card_layout_ignores_the_process_table() -> None:
    chips = parse_npu_smi_info((SAMPLES / "info-ascend910-2x2.txt").read_text())
    assert [(c.npu, c.chip) for c in chips] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert chips[3].bus_id == "0000:9B:00.0" and chips[3].hbm_used_mb == 40003
    assert all(c.health == "OK" for c in chips)


def test_npu_smi_output_without_chip_rows_is_an_error() -> None:
    with pytest.raises(NpuSmiParseError):
        parse_npu_smi_info("| npu-smi 24.1.rc2   Version: 24.1.rc2 |\n| something else |\n")
    assert parse_npu_smi_info("") == []


def test_npu_smi_topology() -> None:
    assert parse_npu_smi_topo((SAMPLES / "topo-hccs.txt").read_text()) == "hccs"
    # the legend mentions HCCS; only the matrix counts
    assert parse_npu_smi_topo((SAMPLES / "topo-pcie.txt").read_text()) == "pcie"
    assert parse_npu_smi_topo("") == "none"


def test_pcie_link_from_sysfs(tmp_path: Path) -> None:
    d = tmp_path / "bus/pci/devices/0000:c1:00.0"
    d.mkdir(parents=True)
    (d / "current_link_speed").write_text("32.0 GT/s PCIe\n")
    (d / "current_link_width").write_text("16\n")
    assert pcie_link(tmp_path, "0000:C1:00.0") == PcieLink(generation=5, width=16)
    assert pcie_link(tmp_path, "0000:00:00.9") is None


def test_numa_nodes(tmp_path: Path) -> None:
    for n in ("node0", "node1", "possible", "has_cpu"):
        (tmp_path / "devices/system/node" / n).mkdir(parents=True)
    assert numa_nodes(tmp_path) == 2
    assert numa_nodes(tmp_path / "missing") == 1
    assert numa_nodes(Path("/sys")) >= 1


def test_no_nvidia_driver_means_no_nvidia_devices() -> None:
    if Path("/dev/nvidiactl").exists():
        pytest.skip("this host has an NVIDIA driver")
    assert nvidia_devices() is None


def test_model_folders_read_facts_and_residency(models_root: Path) -> None:
    (m,) = model_folders(models_root)
    assert m.name == "tiny-wan"
    facts = describe(models_root / "tiny-wan")
    assert m.facts is not None
    assert (m.facts.bytes, m.facts.blocks, m.facts.largest_block_bytes) == (
        facts.bytes, facts.blocks, facts.largest_block_bytes,
    )
    files = sorted((models_root / "tiny-wan").rglob("*.safetensors"))
    assert m.files_bytes == sum(f.stat().st_size for f in files)
    # just written: the page cache holds it
    assert m.resident_bytes == m.files_bytes and m.resident_ratio == 1.0


def test_model_facts_are_parsed_again_only_when_the_transformer_files_change(tmp_path: Path) -> None:
    root = tmp_path / "models"
    write_wan_folder(root / "m", blocks=3)
    (first,) = model_folders(root)
    (again,) = model_folders(root)
    assert again.facts == first.facts and first.facts is not None and first.facts.blocks == 3
    write_wan_folder(root / "m", blocks=5)  # rewritten in place: new sizes and mtimes
    (changed,) = model_folders(root)
    assert changed.facts is not None and changed.facts.blocks == 5


def test_folder_with_unknown_model_class_keeps_bytes_without_facts(tmp_path: Path) -> None:
    root = tmp_path / "models"
    write_wan_folder(root / "odd")
    (root / "odd" / "transformer" / "config.json").write_text(json.dumps({"_class_name": "SomethingNew"}))
    (m,) = model_folders(root)
    assert m.facts is None and m.files_bytes > 0
    assert model_folders(tmp_path / "missing") == [] and model_folders(None) == []


def test_build_profile_on_a_cpu_host(models_root: Path) -> None:
    p = build_profile("n1", NO_DEVICES, proc=ProcFS(Path("/proc")), models=model_folders(models_root))
    assert p.accelerator.vendor == "none" and p.accelerator.count == 0
    assert p.host_memory_bytes == ProcFS(Path("/proc")).meminfo()["MemTotal"]
    assert not p.can_register_page_cache and not p.measured
    assert set(p.models) == {"tiny-wan"}
    assert NodeProfile.from_annotation(p.to_annotation()) == p


@pytest.mark.parametrize(
    "devices, h2d, coll, register",
    [
        (Devices(Accelerator(vendor="nvidia", model="NVIDIA H200", count=8, memory_bytes=141 * GiB), "nvlink",
                 PcieLink(generation=5, width=16)), 55_300_000_000, 360_000_000_000, True),
        (Devices(Accelerator(vendor="ascend", model="910B3", count=8, memory_bytes=64 * GiB), "hccs", None),
         25_000_000_000, 56_000_000_000, False),
        (Devices(Accelerator(vendor="nvidia", model="NVIDIA L40S", count=4, memory_bytes=48 * GiB), "pcie",
                 PcieLink(generation=4, width=16)), 25_000_000_000, 20_000_000_000, True),
    ],
    ids=["h200-nvlink", "910b3-hccs", "l40s-pcie"],
)
def test_build_profile_uses_nominal_figures(devices: Devices, h2d: int, coll: int, register: bool) -> None:
    p = build_profile("n", devices, proc=ProcFS(Path("/proc")))
    assert p.h2d_bandwidth_bps == h2d
    assert p.interconnect.collective_bandwidth_bps == coll
    assert p.can_register_page_cache is register
    assert p.accelerator == devices.accelerator
