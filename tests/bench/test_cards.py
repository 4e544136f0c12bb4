"""bench/results/CARDS.json: every committed result names the card it came from and how that was
told (or says it cannot be), and the index is what the files say today (python -m bench cards)."""

from __future__ import annotations

import json

from bench.lib import cards
from bench.lib.records import INDEX, RESULTS


def test_every_result_is_in_the_index_and_the_index_is_what_the_files_say() -> None:
    committed = json.loads(INDEX.read_text())["files"]
    on_disk = {str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file() and p != INDEX}
    assert set(committed) == on_disk, "run python -m bench cards"
    assert committed == cards.build()["files"], "run python -m bench cards"
    assert all(e["told_by"] for e in committed.values())


def test_a_raw_named_for_one_card_but_made_on_another_says_so() -> None:
    files = json.loads(INDEX.read_text())["files"]
    pairs = files["raw-lora-h200-2026-12-06-wan21-kernel.json"]
    assert pairs["card"] == cards.H100 and pairs["misnamed"] == "the name says h200, the record says " + cards.H100
    assert "misnamed" not in files["raw-lora-h200-2026-12-06-wan21-pairs.json"]  # that one did run on an H200


def test_a_start_without_a_device_name_is_told_by_the_budget_its_logs_name() -> None:
    entry = json.loads(INDEX.read_text())["files"]["raw-ready-h200-2026-12-03-s.json"]
    assert entry["card"] == cards.H200 and "device budget of 149.3 GB" in entry["told_by"]


def test_only_device_names_and_budgets_tell_a_card_never_the_product_s_prose() -> None:
    prose = "imports (measured: ~8 s for Wan2.1 on an H200 host); the device budget is 68.7 GB"
    assert cards._from_text([prose])[0] is None  # an H100's budget, and prose
    assert cards._from_text(["the device budget is 149.3 GB"])[0] == cards.H200
    assert cards._from_text(["torch 2.11.0 NVIDIA H100 80GB HBM3"])[0] == cards.H100
    assert cards._from_text(["device memory capped at 68719476736 bytes (0.4578 of the device)"])[0] == cards.H200
