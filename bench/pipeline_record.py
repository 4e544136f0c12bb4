"""The record of `bench/pipeline.py`: its summary, its markdown, and the merge of several calls.

Owns: `summarize` (the figures the issues ask for, computed from the runs: each run's request
seconds with their spread, `seconds_of`; ratios of one call's two runs, median over median and first
over first, `_over`; which runs served, host and device memory per run), `markdown` (generated from the JSON), and `merge` (several
calls' raw records into one; a later file's run replaces an earlier one, which stays as
`<name>@<file>`). Host memory from before `/proc/PID/smaps_rollup` was read (per-mapping smaps has
no `Pss_Anon` line, so every such record says 0) is marked unmeasured in a merged record.
Must never: put a number into the record that no run measured, divide runs of two calls, or show a
call's one kept figure (the fastest of its requests) without saying so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.lib import merge as merging
from bench.lib.stats import either_ratio, figure_text, kept, spread
from bench.import_profile import cached

# summary entries per run (in the runs table, or only in the JSON): not repeated in the markdown's summary
PER_RUN = ("peak_device_bytes", "host_memory", "component_peak_device_bytes", "request_seconds")
ANON_UNMEASURED = ("not measured: read from per-mapping /proc/PID/smaps, which has no Pss_Anon line "
                   "(bench/NOTES.md section 17)")


def seconds_of(r: Any) -> dict | None:
    """A run's request seconds: their spread (first, median, n, min, max) where the call kept every
    request; else the one figure it kept (the fastest of its requests, how many not recorded)."""
    if not isinstance(r, dict):
        return None
    if r.get("request_seconds"):
        return spread(r["request_seconds"], first=r.get("first_request_seconds", "samples[0]"))
    return kept(r["seconds"]) if isinstance(r.get("seconds"), (int, float)) else None


def _over(a: Any, b: Any) -> dict | None:
    """Run `a`'s request seconds over run `b`'s, the same statistic on both sides (`either_ratio`);
    runs of two calls (a merge's `source`) are not divided: the calls they came from are named."""
    sa, sb = seconds_of(a), seconds_of(b)
    if sa is None or sb is None:
        return None
    if a.get("source") != b.get("source"):
        return {"not_same_call": [a.get("source"), b.get("source")]}
    return either_ratio(sa, sb)


def _call_facts(rec: dict, key: str, run: dict) -> Any:
    """`rec[key]` as recorded by the call that measured `run` (a merged record keeps one per file)."""
    facts = rec.get(key)
    return facts.get(run["source"]) if isinstance(facts, dict) and run and "source" in run else facts


def _bytecode_cached(rec: dict, run: dict) -> bool | None:
    """Whether torch and diffusers had cached bytecode in the call that measured `run` (None: not recorded)."""
    facts = _call_facts(rec, "bytecode", run)
    states = [cached(facts, p) for p in ("torch", "diffusers")] if run and facts else [None]
    return None if None in states else all(states)


# serve runs whose bytes differ by design: FP8 weights (their drift is `fp8_drift`) and the 12 GiB
# cap's tiled VAE decode
OTHER_BYTES_BY_DESIGN = ("_fp8", "_capped_12gib")


def _same_bytes(runs: dict) -> bool | None:
    """Whether the current serve runs (a merge keeps replaced ones as `<name>@<file>`: other code,
    other bytes) that compute the same thing returned the same output; None with fewer than two."""
    shas = [r["output_sha256"] for n, r in runs.items() if n.startswith("serve_") and "@" not in n
            and not n.endswith(OTHER_BYTES_BY_DESIGN) and isinstance(r, dict) and "output_sha256" in r]
    return None if len(shas) < 2 else len(set(shas)) == 1


def summarize(rec: dict) -> dict:
    def run(model: str, name: str) -> dict:
        """The model's run at full size (key without `@L<layers>`) if it has one, else the first shrunk one."""
        for k in sorted(rec["models"], key=lambda k: "@" in k):
            if k.split("@")[0] == model and name in rec["models"][k]:
                return rec["models"][k][name]
        return {}

    peaks = {f"{m}/{name}": {"ranks": r.get("peak_device_bytes"), "components": r.get("component_reports")}
             for m, v in rec["models"].items() for name, r in v.items()
             if isinstance(r, dict) and "peak_device_bytes" in r}
    hosts = [r["host_bytes_over_checkpoint"] for v in rec["models"].values() for r in v.values()
             if isinstance(r, dict) and "host_bytes_over_checkpoint" in r]
    return {
        # the headline offloaded run (part of each transformer kept resident, RESIDENT_SHARE) ...
        "wan21_e2e_over_resident": _over(run("wan21", "serve_rank_local_partial"), run("wan21", "diffusers_resident")),
        "wan21_capped24_over_uncapped": _over(run("wan21", "serve_capped_24gib"),
                                              run("wan21", "serve_rank_local_partial")),
        "flux_e2e_over_resident": _over(run("flux", "serve_rank_local_partial"), run("flux", "diffusers_resident")),
        "wan22_e2e_over_resident": _over(run("wan22", "serve_rank_local_partial"), run("wan22", "diffusers_resident")),
        # ... every block streamed on one GPU, and one request over the pooled host links of dp GPUs
        "streamed_only_over_resident": {m: _over(v.get("serve_rank_local", {}), v.get("diffusers_resident", {}))
                                        for m, v in rec["models"].items()},
        "allgather_single_over_resident": {m: _over(r, v.get("diffusers_resident", {}))
                                           for m, v in rec["models"].items() for n, r in v.items()
                                           if n.startswith("serve_allgather_dp") and "@" not in n
                                           and isinstance(r, dict)},
        # our server with everything resident (what the policy picks where the pipeline fits): the
        # serving cost alone (HTTP, PNG/MP4) against the same pipeline in plain diffusers
        "serve_resident_over_resident": {m: _over(v.get("serve_resident", {}), v.get("diffusers_resident", {}))
                                         for m, v in rec["models"].items()},
        "host_bytes_over_checkpoint": max(hosts) if hosts else None,
        "wan21_ready_seconds": run("wan21", "serve_ready_no_warmup").get("ready_seconds"),
        # ... measured with torch's and diffusers' bytecode cached (as an image pip built has it)?
        "wan21_ready_bytecode_cached": _bytecode_cached(rec, run("wan21", "serve_ready_no_warmup")),
        # every such run a merge kept (the spread: start-up is CPU-bound Python, it varies by host load)
        "wan21_ready_seconds_all": [
            {"seconds": r.get("ready_seconds"), "bytecode_cached": _bytecode_cached(rec, r),
             "optional_packages": _call_facts(rec, "optional_packages", r), "source": r.get("source")}
            for m, v in rec["models"].items() if m == "wan21" for n, r in v.items()
            if n.split("@")[0] == "serve_ready_no_warmup" and isinstance(r, dict) and "ready_seconds" in r],
        "bytes_identical_to_resident_serve": {m: _same_bytes(v) for m, v in rec["models"].items()},
        **_small_gpu(rec, run),
        "peak_device_bytes": peaks,
        # every current run's request seconds: spread, or the one figure the call kept
        "request_seconds": {f"{m}/{n}": seconds_of(r) for m, v in rec["models"].items() for n, r in v.items()
                            if "@" not in n and seconds_of(r)},
    }


def _served(r: dict) -> bool | None:
    """Whether a serve run became ready and answered its requests (None: not run)."""
    return None if not r else "seconds" in r and not r.get("error")


def _small_gpu(rec: dict, run: Any) -> dict:
    """The small-GPU figures (issue 27): default mode under a cap, against diffusers' group offloading
    under the same cap, the largest accepted request, host memory per run."""
    models = rec["models"]
    current = {m: {n: r for n, r in v.items() if isinstance(r, dict) and "@" not in n} for m, v in models.items()}
    def over(model: str, a: str, b: str) -> dict | None:
        return _over(run(model, a), run(model, b))

    return {
        "wan21_capped24_default_mode_serves": _served(run("wan21", "serve_default_capped_24gib")),
        "wan21_capped24_default_over_uncapped": over("wan21", "serve_default_capped_24gib", "serve_rank_local_partial"),
        # ... and against the uncapped server in its default mode (on an H200: resident)
        "wan21_capped24_default_over_uncapped_default": over("wan21", "serve_default_capped_24gib", "serve_default"),
        "wan21_capped12_default_mode_serves": _served(run("wan21", "serve_default_capped_12gib")),
        "wan21_capped12_largest_request_served": (run("wan21", "serve_default_capped_12gib").get("largest_request")
                                                  or {}).get("ok"),
        # the default (auto resident blocks) against none, both under the 24 GiB cap
        "qwen_capped24_auto_blocks_over_zero": over("qwen", "serve_default_capped_24gib",
                                                    "serve_capped_24gib_zero_resident"),
        # FP8 streaming against bfloat16, both with no resident block under the 24 GiB cap, and its drift
        "fp8_over_bf16_streamed_image_capped24": over("flux", "serve_capped_24gib_zero_resident_fp8",
                                                      "serve_capped_24gib_zero_resident"),
        "fp8_drift": {m: v["fp8_drift"] for m, v in models.items() if v.get("fp8_drift")},
        "beyond_limits_refused_naming_the_limit": {
            f"{m}/{n}": r["beyond_limits"].get("status") == 400 and r["beyond_limits"].get("names_limit")
            for m, v in current.items() for n, r in v.items() if isinstance(r.get("beyond_limits"), dict)},
        "capped24_over_diffusers_group_offload": {
            m: _over(v.get("serve_default_capped_24gib", {}), v.get("diffusers_group_offload_capped_24gib", {}))
            for m, v in current.items()},
        "largest_request_served": {f"{m}/{n}": r["largest_request"].get("ok") for m, v in current.items()
                                   for n, r in v.items() if isinstance(r.get("largest_request"), dict)},
        "host_memory": {f"{m}/{n}": r["host_memory"] for m, v in current.items() for n, r in v.items()
                        if isinstance(r.get("host_memory"), dict)},
        "component_peak_device_bytes": {f"{m}/{n}": r["component_peak_device_bytes"] for m, v in current.items()
                                        for n, r in v.items() if r.get("component_peak_device_bytes")},
    }


def markdown(rec: dict) -> str:
    lines = [f"# Full-size pipelines ({rec['date']}, {rec['device']})", "", "Generated from the JSON beside it.", "",
             "## Summary", "", "```json", json.dumps({k: v for k, v in rec["summary"].items() if k not in PER_RUN},
                                                      indent=2), "```", "", "## Runs", "",
             "| model | run | seconds | weight wait s | ready s | host/ckpt | anon GB | file GB | sha256 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m, v in rec["models"].items():
        for name, r in v.items():
            if isinstance(r, dict) and name.startswith(("serve_", "diffusers_")):
                sha = (r.get("output_sha256") or r.get("frames_sha256") or r.get("error") or "")[:16]
                host = r.get("host_memory") or {}
                secs = seconds_of(r)
                lines.append(f"| {m} | {name} | {figure_text(secs, ' s') if secs else ''} | {r.get('gather_wait_seconds_per_request', '')} | "
                             f"{r.get('ready_seconds', '')} | "
                             f"{r.get('host_bytes_over_checkpoint', '')} | {_gb(host.get('pss_anon_bytes'))} | "
                             f"{_gb(host.get('pss_file_bytes'))} | {sha} |")
    lines += ["", "seconds: each request's, the median with n, min-max and the first request; a call that kept "
                  "only its fastest request says `n=1, best of K`.", "", "weight wait s: rank 0's compute waiting for weights per timed request (`dlo_gather_wait_seconds`: "
                  "what the copies did not hide).", "", "Commands: `" + rec["command"] + "`", ""]
    return "\n".join(lines)


def _gb(n: Any) -> str:
    return f"{n / 1e9:.2f}" if isinstance(n, (int, float)) else ("unmeasured" if n is None else "")


def _mark_unmeasured_anon(r: dict) -> dict:
    """A run whose host memory predates smaps_rollup: its `pss_anon_bytes` (always 0) is no figure."""
    host = r.get("host_memory")
    if isinstance(host, dict) and "source" not in host and "pss_anon_bytes" in host:
        r = {**r, "host_memory": {**host, "pss_anon_bytes": None, "pss_anon_note": ANON_UNMEASURED}}
    return r


def merge(files: list[Path], stem: Path) -> dict:
    """Several calls' records -> one: per model, a later file's run replaces an earlier one of the same
    name, which stays beside it as `<name>@<its file's stem>`; every run names its file (`source`)."""
    # one card's calls only (a call whose card cannot be told stays so in the sources)
    rec: dict[str, Any] = {"sources": [str(f) for f in files], "card": merging.one_card(merging.load(files)),
                           "models": {}}
    for f in files:
        part = json.loads(f.read_text())
        rec.setdefault("date", part["date"])
        rec["device"] = part["device"]
        rec.setdefault("commands", []).append(part["command"])
        rec.setdefault("bytecode", {})[f.stem] = part.get("bytecode")
        rec.setdefault("optional_packages", {})[f.stem] = part.get("optional_packages")
        for m, runs in part["models"].items():
            into = rec["models"].setdefault(m, {})
            for name, r in runs.items():
                if isinstance(r, dict) and (name.startswith(("serve_", "diffusers_"))):
                    r = {**_mark_unmeasured_anon(r), "source": f.stem}
                    if name in into:
                        into[f"{name}@{into[name]['source']}"] = into[name]
                into[name] = r
    rec["command"] = " ; ".join(rec["commands"])
    rec["summary"] = summarize(rec)
    stem.with_suffix(".json").write_text(json.dumps(rec, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(rec))
    return rec


