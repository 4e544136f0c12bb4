"""The plan shows, for every phase the largest accepted requests run, the need it takes and where it
comes from: measured on this device at that shape, a fit of shapes measured here, or the table's
prediction (extrapolated or not), with the table's figure beside a measured one."""

from __future__ import annotations

import dataclasses

from dlo.plan.measured import describe_needs, phase_needs
from dlo.plan.memory_model import Geometry, PipelineMemory, RequestBounds, Shape
from dlo.plan.memory_table import MemoryTable


def _memory() -> PipelineMemory:
    bounds = RequestBounds(832, 480, 17, 1)
    return PipelineMemory("wan", Geometry(16, 4), {}, {}, {}, bounds, 10**12, MemoryTable.load())


def test_each_phase_names_its_source_and_the_tables_figure_beside_a_measured_one() -> None:
    memory = _memory()
    table_only = {(n["part"], n["shape"]): n for n in phase_needs(memory)}
    video, image = Shape(832, 480, 17, 1), Shape(832, 480, 1, 1)
    assert {("transformer", str(video)), ("vae_decode", str(video)), ("vae_decode", str(image))} <= set(table_only)
    assert all(n["source"].startswith("table") and n["need_bytes"] == n["table_bytes"] for n in table_only.values())
    measured = dataclasses.replace(memory, measured={("transformer", video): 7 * 10**9, ("vae_decode", image): 3 * 10**9})
    needs = {(n["part"], n["shape"]): n for n in phase_needs(measured)}
    t = needs[("transformer", str(video))]
    assert (t["source"], t["need_bytes"]) == ("measured", 7 * 10**9)
    assert t["table_bytes"] == table_only[("transformer", str(video))]["table_bytes"]  # the table's beside it
    lines = describe_needs(tuple(needs.values()))
    assert any(line.startswith(f"transformer at {video}: 7.0 GB measured (the table: ") for line in lines), lines
