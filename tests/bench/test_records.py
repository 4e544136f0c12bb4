"""bench/lib: the record format every suite writes (provenance read from where it runs), spreads and
ratios of one statistic, and the one merge (one card; a later run replaces an earlier one, kept)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.lib import merge as merging
from bench.lib import packages, records, stats

ROOT = Path(__file__).resolve().parents[2]


def test_a_spread_keeps_the_first_request_apart_from_the_median() -> None:
    s = stats.spread([30.0, 10.0, 12.0, 11.0])
    assert s == {"first": 30.0, "median": 11.5, "n": 4, "min": 10.0, "max": 30.0}
    assert stats.spread([10.0, 12.0], first=None)["first"] is None  # warm-up untimed: said, not guessed
    assert "first not recorded" in stats.text(stats.spread([5.0], first=None), " ms")
    with pytest.raises(ValueError):
        stats.spread([])


def test_a_ratio_divides_medians_by_medians_and_firsts_by_firsts() -> None:
    r = stats.ratio(stats.spread([12.0, 10.0, 10.0]), stats.spread([8.0, 5.0, 5.0, 5.0]))
    assert r == {"median": 2.0, "first": 1.5, "n": [3, 4]}
    assert stats.ratio(stats.spread([4.0], first=None), stats.spread([2.0]))["first"] is None
    assert stats.ratio_text(r) == "2.000x (medians, first requests 1.500x)"


def test_a_cpu_record_names_its_card_commit_versions_and_package_set(tmp_path: Path) -> None:
    rec = records.raw("offload", "cpu", {"results": {}}, argv=["bench/__main__.py", "offload", "run"])
    prov = rec["provenance"]
    assert rec["suite"] == "offload" and rec["kind"] == "raw" and prov["command"] == "python -m bench offload run"
    assert prov["card"]["name"].startswith("cpu: ") and prov["card"]["memory_bytes"] > 0
    assert len(prov["commit"]["sha"]) == 40 and prov["commit"]["told_by"] == "git"
    assert prov["versions"]["torch"] and prov["versions"]["python"].count(".") == 2
    assert prov["packages"]["digest"].startswith("sha256:") and prov["packages"]["count"] > 10
    assert records.card_of(rec) == prov["card"]["name"]


def test_the_package_set_is_compared_with_the_lock(tmp_path: Path) -> None:
    have = packages.installed()
    lock = tmp_path / "engine.lock"
    pins = {n: v for n, v in have.items() if n not in packages.TOOLS}
    lock.write_text("--index-url https://pypi.org/simple\n" + "".join(
        f"{n}=={v} \\\n    --hash=sha256:00\n" for n, v in sorted(pins.items())))
    assert packages.read_lock(lock) == pins
    assert packages.package_set(lock)["matches_lock"] is True
    (name, version), *_ = sorted(pins.items())
    lock.write_text("".join(f"{n}=={v}\n" for n, v in sorted(pins.items()) if n != name) + "absent-pkg==1.0\n")
    got = packages.package_set(lock)
    assert not got["matches_lock"] and got["extra"] == [f"{name}=={version}"] and got["missing"] == ["absent-pkg==1.0"]


def _raw(tmp_path: Path, name: str, card: str, runs: dict) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"suite": "x", "provenance": {"card": {"name": card}, "command": name}, "runs": runs}))
    return path


def test_the_merge_joins_one_card_s_runs_and_keeps_a_replaced_one(tmp_path: Path) -> None:
    a = _raw(tmp_path, "a", "NVIDIA H200", {"resident": 1, "allgather": 2})
    b = _raw(tmp_path, "b", "NVIDIA H200", {"allgather": 3})
    sources = merging.load([a, b])
    assert merging.keyed(sources, "runs") == {"resident": 1, "allgather": 3, "allgather@a": 2}
    rec = merging.merged("x", sources, {"runs": {}})
    assert rec["card"] == "NVIDIA H200" and [s["file"] for s in rec["sources"]] == ["a.json", "b.json"]
    c = _raw(tmp_path, "c", "NVIDIA H100 80GB HBM3", {"resident": 4})
    with pytest.raises(merging.MergeError, match="c.json: NVIDIA H100 80GB HBM3"):
        merging.merged("x", merging.load([a, c]), {})
    assert merging.merged("x", merging.load([a, c]), {}, mixed=True)["card"] is None


def test_a_record_from_before_the_provenance_names_the_card_its_fields_kept() -> None:
    legacy = json.loads((ROOT / "bench" / "results" / "raw-h200-40l-a.json").read_text())
    assert records.card_of(legacy) == "NVIDIA H200"
    assert records.card_of({"device": "1 x NVIDIA H100 80GB HBM3"}) == "NVIDIA H100 80GB HBM3"
    assert records.card_of({"device": "cuda"}) is None


def test_the_offload_merge_heads_with_the_default_path_and_its_spread(tmp_path: Path) -> None:
    raws = [str(ROOT / "bench" / "results" / f"raw-h200-40l-{x}.json") for x in "ab"]
    r = subprocess.run([sys.executable, "-m", "bench", "offload", "merge", *raws, "--out", str(tmp_path), "--stem", "m"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads((tmp_path / "m.json").read_text())
    image = rec["summary"]["systems"]["dlo_rank_local_registered"]["workloads"]["image"]
    assert round(image["over_bound"], 3) == 0.991 and image["call_ms"]["n"] == 3
    assert rec["card"] == "NVIDIA H200" and rec["summary"]["image"]["fastest_dlo_variant"] == "dlo_rank_local_arena"
    assert "| dlo_rank_local_registered | 512.5 | 3 | 511.2-512.6 | - |" in (tmp_path / "m.md").read_text()
