"""bench/host_memory.py and bench/pipeline_record.py: host memory from smaps_rollup (anonymous bytes
were 0 in every record read from per-mapping smaps), and the merged record marking those unmeasured."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench.host_memory import tree_memory
from bench.pipeline_record import merge


def test_host_memory_reads_anonymous_and_file_backed_pss_from_smaps_rollup() -> None:
    ballast = bytearray(64 << 20)  # 64 MiB of private anonymous memory, touched
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    mem = tree_memory(os.getpid(), children=False)
    assert mem["source"] == "smaps_rollup"
    assert mem["pss_anon_bytes"] >= 64 << 20 and mem["pss_file_bytes"] > 0  # the interpreter's own files
    assert abs(mem["pss_bytes"] - mem["pss_anon_bytes"] - mem["pss_file_bytes"] - mem["pss_shmem_bytes"]) < 1 << 20
    assert mem["rss_peak_bytes"] >= mem["rss_bytes"] > 0
    del ballast


def _record(stem: str, runs: dict) -> dict:
    return {"date": "2026-12-01", "device": "1 x NVIDIA H200", "command": f"python -m bench pipeline --stem {stem}",
            "models": {"wan21": runs}}


def test_merge_marks_anonymous_bytes_before_smaps_rollup_unmeasured(tmp_path: Path) -> None:
    old = {"serve_rank_local_partial": {"seconds": 11.8, "output_sha256": "a", "host_memory": {
        "pss_bytes": 10, "pss_safetensors_bytes": 8, "pss_anon_bytes": 0}}}
    new = {"serve_default_capped_24gib": {"seconds": 12.0, "output_sha256": "a", "largest_request": {"ok": True},
                                          "host_memory": {"pss_bytes": 10, "pss_anon_bytes": 2, "pss_file_bytes": 8,
                                                          "source": "smaps_rollup"}},
           "diffusers_group_offload_capped_24gib": {"seconds": 16.0, "frames_sha256": "b",
                                                    "component_peak_device_bytes": {"transformer": 5},
                                                    "host_memory": {"pss_anon_bytes": 52, "source": "smaps_rollup"}}}
    files = []
    for stem, runs in (("raw-old", old), ("raw-new", new)):
        files.append(tmp_path / f"{stem}.json")
        files[-1].write_text(json.dumps(_record(stem, runs)))
    rec = merge(files, tmp_path / "merged")
    runs = rec["models"]["wan21"]
    assert runs["serve_rank_local_partial"]["host_memory"]["pss_anon_bytes"] is None
    assert "Pss_Anon" in runs["serve_rank_local_partial"]["host_memory"]["pss_anon_note"]
    assert runs["serve_default_capped_24gib"]["host_memory"]["pss_anon_bytes"] == 2  # measured: kept
    s = rec["summary"]
    assert s["wan21_capped24_default_mode_serves"] is True
    # two calls' runs are not divided: the calls are named instead
    assert s["wan21_capped24_default_over_uncapped"] == {"not_same_call": ["raw-new", "raw-old"]}
    assert s["capped24_over_diffusers_group_offload"] == {"wan21": {
        "fastest_over_fastest": 0.75, "n": [1, 1],
        "statistic": "a side kept only its fastest try: fastest over fastest, not a median"}}
    assert s["largest_request_served"] == {"wan21/serve_default_capped_24gib": True}
    assert s["component_peak_device_bytes"] == {"wan21/diffusers_group_offload_capped_24gib": {"transformer": 5}}
    assert "| unmeasured |" in (tmp_path / "merged.md").read_text()


def test_the_small_gpu_summary_holds_each_figure_of_issue_27(tmp_path: Path) -> None:
    def run(seconds: float, **extra: object) -> dict:
        return {"seconds": seconds, "output_sha256": "a", **extra}

    refused = {"beyond_limits": {"status": 400, "names_limit": True, "limit": "limit of 17"}}
    models = {
        "wan21": {"serve_default": run(12.0), "serve_default_capped_24gib": run(12.3, **refused),
                  "serve_default_capped_12gib": run(13.0, largest_request={"ok": True}),
                  "diffusers_group_offload_capped_24gib": {"seconds": 17.6, "frames_sha256": "b"}},
        "qwen": {"serve_default_capped_24gib": run(11.0), "serve_capped_24gib_zero_resident": run(15.8)},
        "flux": {"serve_capped_24gib_zero_resident": run(9.0), "serve_capped_24gib_zero_resident_fp8": run(5.0),
                 "fp8_drift": {"max_abs_levels": 12.0, "psnr_db": 38.0}},
    }
    (tmp_path / "raw.json").write_text(json.dumps({"date": "2026-12-01", "device": "1 x NVIDIA H200",
                                                   "command": "python -m bench pipeline --small-gpu",
                                                   "models": models}))
    s = merge([tmp_path / "raw.json"], tmp_path / "small-gpu")["summary"]
    assert s["wan21_capped24_default_over_uncapped_default"]["fastest_over_fastest"] == 1.025
    assert s["wan21_capped12_default_mode_serves"] is True and s["wan21_capped12_largest_request_served"] is True
    assert s["qwen_capped24_auto_blocks_over_zero"]["fastest_over_fastest"] == round(11.0 / 15.8, 4)
    assert s["fp8_over_bf16_streamed_image_capped24"]["fastest_over_fastest"] == round(5.0 / 9.0, 4)
    assert s["fp8_drift"] == {"flux": {"max_abs_levels": 12.0, "psnr_db": 38.0}}
    assert s["beyond_limits_refused_naming_the_limit"] == {"wan21/serve_default_capped_24gib": True}
    assert s["capped24_over_diffusers_group_offload"]["wan21"]["fastest_over_fastest"] == round(12.3 / 17.6, 4)


def test_every_run_has_its_spread_and_a_ratio_divides_one_statistic_of_one_call(tmp_path: Path) -> None:
    """Request seconds kept: first, median, n, min, max; a ratio is median over median and first over
    first (never the fastest over the fastest); a call that kept one figure says n=1, best of K."""
    runs = {"serve_rank_local_partial": {"seconds": 11.0, "request_seconds": [13.0, 11.0, 12.0],
                                         "first_request_seconds": 13.0, "output_sha256": "a"},
            "diffusers_resident": {"seconds": 10.0, "request_seconds": [10.0, 12.0, 11.0], "frames_sha256": "b"},
            "serve_resident": {"seconds": 10.5, "output_sha256": "a"}}
    (tmp_path / "raw.json").write_text(json.dumps(_record("raw", runs)))
    rec = merge([tmp_path / "raw.json"], tmp_path / "merged")
    s = rec["summary"]
    assert s["request_seconds"]["wan21/serve_rank_local_partial"] == {"first": 13.0, "median": 12.0, "n": 3,
                                                                      "min": 11.0, "max": 13.0}
    assert s["request_seconds"]["wan21/serve_resident"] == {"kept": 10.5, "n": 1, "best_of": "not recorded"}
    r = s["wan21_e2e_over_resident"]
    assert r["median"] == round(12.0 / 11.0, 4) and r["first"] == 1.3 and r["n"] == [3, 3]  # not 11/10
    assert s["serve_resident_over_resident"]["wan21"]["fastest_over_fastest"] == round(10.5 / 10.0, 4)  # the fastest of each
    md = (tmp_path / "merged.md").read_text()
    assert "12.000 s (median of 3: 11.000-13.000; first 13.000)" in md and "(n=1, best of not recorded)" in md
    assert "request_seconds" not in md.split("## Runs")[0]  # per run: in the table, not the summary block
