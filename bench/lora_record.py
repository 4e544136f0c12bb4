"""The record of `bench/lora.py`: the summary of its runs, the markdown and the merge of its calls.

Owns: `summarize` (per model: per-block ratios, each served run's request seconds with and without
the adapter with their spread and the end-to-end ratios median over median and first over first, bytes),
`markdown` and `merge` (raw records of one card into `<stem>.{json,md}`, each step of a model from
the call that ran it).
Must never: measure (the runs are `bench/lora.py`'s).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.lib import merge as merging
from bench.lib import records
from bench.lib.stats import any_ratio_text, either_ratio, figure_text, kept, spread

GOAL = 1.03  # the issue's: the request with the adapter over the same request without it
RANK = 64
MERGE_SUFFIX = "_merge"  # a serve run with `--lora-apply merge` (its bytes are fuse_lora's, not the branch's)
FUSED_INFIX = "_fused"  # `--lora-merge-kernel triton`: each merge in one pass
TORCH_MERGE_INFIX = "_torch_merge"  # `--lora-merge-kernel torch`: peft's two steps as torch ops
AUTO_SUFFIX = "_auto"  # a serve run with the default `--lora-apply auto` (merged above --lora-merge-above tokens)
PAIRS_INFIX = "_pairs"  # `--cfg-pairs`: a step's cond and uncond calls walk the streamed blocks together
UNPAIRED_INFIX = "_unpaired"  # `--no-cfg-pairs` (pairs are the default from 2026-12-06 on)


def apply_of(flags: list[str] | tuple[str, ...], name: str = "") -> str:
    """The `--lora-apply` a serve run's flags give; without the flag, the default of the run's time:
    auto for the `*_auto` runs, the branch for the others (raws from before auto became the default,
    which named no `--lora-apply` for the branch)."""
    flags = list(flags)
    if "--lora-apply" in flags:
        return flags[flags.index("--lora-apply") + 1]
    return "auto" if name.endswith("_auto") else "branch"


def _ratio(a: Any, b: Any) -> float | None:
    return round(a / b, 4) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def seconds_of(r: dict, key: str = "request_seconds") -> dict[str, dict] | None:
    """A served run's seconds (`request_seconds`, or `step_seconds`: the denoising steps) per variant
    (base, lora): their spread, or the one figure (the fastest) a call kept."""
    got = r.get(key)
    if isinstance(got, dict) and all(got.values()):
        return {v: spread(xs) for v, xs in got.items()}
    if key == "request_seconds" and isinstance(r.get("seconds"), dict):
        return {v: kept(x) for v, x in r["seconds"].items()}
    return None


def _goal_met(r: dict) -> bool:
    return r.get("median", r.get("fastest_over_fastest")) <= GOAL


def summarize(rec: dict) -> dict:
    """The issue's figures, from the runs only: per model the per-block and end-to-end ratios against
    the goal, whether the controls kept the bits, the bytes per adapter."""
    out: dict[str, Any] = {"goal": GOAL}
    for key, m in rec["models"].items():
        s: dict[str, Any] = {}
        rows = (m.get("per_block") or {}).get("workloads") or {}
        s["per_block_ratio"] = {t: {v: _ratio(r[v]["block_ms"], r["base"]["block_ms"]) for v in r if v != "base"}
                                for t, r in rows.items()}
        s["fold_bit_identical"] = all(r["lora_unfolded"]["bit_identical_to_lora"] for r in rows.values()) if rows else None
        # the two orders of B's product and the add: a run before the engine added in the GEMM on cuda
        # has the addmm as its control, a later one the separate add ([Note: the add in B's product])
        first = next(iter(rows.values()), {})
        control = next((c for c in ("lora_separate_add", "lora_addmm") if c in first), None)
        s["add_in_gemm_control"] = control
        s["add_in_gemm_bit_identical"] = (all(r[control]["bit_identical_to_lora"] for r in rows.values())
                                          if control else None)
        serves = {n: r for n, r in m.items() if n.startswith("serve_") and isinstance(r, dict) and "ratio" in r}
        s["request_seconds"] = {n: seconds_of(r) for n, r in serves.items()}
        s["end_to_end_ratio"] = {n: either_ratio(x["lora"], x["base"]) for n, x in s["request_seconds"].items()}
        s["end_to_end_meets_goal"] = {n: _goal_met(r) for n, r in s["end_to_end_ratio"].items()}
        # the denoising steps only (the decode and the encoding, the same with and without, left out)
        steps = {n: seconds_of(r, "step_seconds") for n, r in serves.items()}
        s["denoise_ratio"] = {n: either_ratio(x["lora"], x["base"]) for n, x in steps.items() if x}
        for field, apply in (("lora_bytes_identical_across_modes", "branch"),
                             ("lora_bytes_identical_across_modes_merged", "merge"),
                             ("lora_bytes_identical_across_modes_auto", "auto")):
            shas = [r["output_sha256"]["lora"] for n, r in serves.items() if apply_of(r["flags"], n) == apply]
            s[field] = len(set(shas)) == 1 if len(shas) > 1 else None
        merge_rows = [r for r in rows.values() if "merge" in r]
        s["merge_in_gemm_bit_identical"] = (all(r["merge_in_gemm"]["bit_identical_to_merge"]
                                                for r in merge_rows) if merge_rows else None)
        s["merge_over_branch_per_block"] = {t: _ratio(r["merge"]["block_ms"], r["lora"]["block_ms"])
                                            for t, r in rows.items() if "merge" in r}
        s["base_bytes_identical_across_modes"] = (len({r["output_sha256"]["base"] for r in serves.values()}) == 1
                                                  if len(serves) > 1 else None)
        s["lora_changes_output"] = (all(r["output_sha256"]["lora"] != r["output_sha256"]["base"] for r in serves.values())
                                    if serves else None)
        s["adapter_bytes"] = {n: {k: a.get(k) for k in ("device_bytes", "allocated_bytes", "host_anon_bytes_after",
                                                       "host_anon_bytes_peak", "file_bytes", "layers")}
                              for n, a in ((m.get("per_block") or {}).get("adapters") or {}).items()}
        s["served_lora_device_bytes"] = {n: r.get("lora_device_bytes") for n, r in serves.items()}
        out[key] = s
    return out


def markdown(rec: dict) -> str:
    s = rec["summary"]
    lines = [f"# LoRA adapters on {rec['device']} ({rec['date']})", ""]
    if rec.get("dry_run"):
        lines += ["**CPU dry run: no figure here is a result.**", ""]
    lines += [f"Goal: <= {GOAL}x the same request without the adapter. Rank {RANK}, from `dlo make-random-lora`. "
              f"Commands: {'; '.join(rec.get('commands', []))}", ""]
    for key, m in rec["models"].items():
        req = m.get("request") or {}
        shape = f"{req.get('size')}" + (f"x{req['frames']}" if req.get("frames") else "") + f", {req.get('steps')} steps"
        lines += [f"## {key} ({m.get('preset')}, {m.get('transformer_blocks')} blocks; request {shape})", ""]
        lines += _per_block_lines(m, s[key]) + _serve_lines(m, s[key]) + _adapter_lines(s[key])
    return "\n".join(lines) + "\n"


def _per_block_lines(m: dict, ms: dict) -> list[str]:
    """The per-block table and the device's bit-identity checks, or why they were not run."""
    if not ms["per_block_ratio"]:
        why = (m.get("per_block") or {}).get("skipped", "not run")
        return [f"Per block: skipped ({why}); see the earlier records in this folder.", ""]
    head = next(iter(ms["per_block_ratio"].values()))
    lines = ["| tokens | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for t, row in ms["per_block_ratio"].items():
        base = m["per_block"]["workloads"][t]["base"]["block_ms"]
        lines.append(f"| {t} (base {base} ms/block) | " + " | ".join(f"{v}x" for v in row.values()) + " |")
    return lines + ["", f"Power-of-two fold bit-identical on the device: {ms['fold_bit_identical']}; B's product "
                        f"added in its GEMM and separately give the same bytes ({ms['add_in_gemm_control']} "
                        f"control): {ms['add_in_gemm_bit_identical']}.", ""]


def _serve_lines(m: dict, ms: dict) -> list[str]:
    """End to end: each served run's seconds, ratio, the adapters' device bytes and the peak."""
    lines = ["| end to end | base s | lora s | lora over base | meets goal | denoising steps only | lora device bytes "
             "| peak device bytes |", "|---|---|---|---|---|---|---|---|"]
    for n, ratio in ms["end_to_end_ratio"].items():
        r, secs = m[n], ms["request_seconds"][n]
        denoise = (ms.get("denoise_ratio") or {}).get(n)
        held = (r.get("lora_device_bytes") or {}).get("0")
        peak = (r.get("peak_device_bytes") or {}).get("0")
        lines.append(f"| {n} | {figure_text(secs['base'], ' s')} | {figure_text(secs['lora'], ' s')} | "
                     f"{any_ratio_text(ratio, 4)} | {ms['end_to_end_meets_goal'][n]} | "
                     f"{any_ratio_text(denoise, 4) if denoise else ''} | {held or ''} | {int(peak) if peak else ''} |")
    for n, r in m.items():  # a run that failed or was skipped says so here too, not only in the raw
        if n.startswith("serve") and isinstance(r, dict) and ("error" in r or "skipped" in r):
            lines.append(f"| {n} | {'failed: ' + r['error'] if 'error' in r else 'skipped: ' + r['skipped']} "
                         "| | | | | | |")
    return lines + ["", "Seconds: each request's, the median with n, min-max and the first request; ratios "
                        "median over median (and first over first) of the same server.", "",
                    f"LoRA bytes identical across modes: {ms['lora_bytes_identical_across_modes']} (branch), "
                        f"{ms.get('lora_bytes_identical_across_modes_merged')} (merge), "
                        f"{ms.get('lora_bytes_identical_across_modes_auto')} (auto); the adapter changes the "
                        f"output: {ms['lora_changes_output']}. Merged in one GEMM and in peft's two steps give the "
                        f"same bytes: {ms.get('merge_in_gemm_bit_identical')}; merge over branch per block: "
                        f"{ms.get('merge_over_branch_per_block')}.", ""]


def _adapter_lines(ms: dict) -> list[str]:
    """Host and device bytes per loaded adapter (the per-block step measures them)."""
    if not ms["adapter_bytes"]:
        return []
    lines = ["| adapter | device bytes | allocator delta | host anon after | host anon peak | file bytes | layers |",
             "|---|---|---|---|---|---|---|"]
    for n, a in ms["adapter_bytes"].items():
        lines.append(f"| {n} | " + " | ".join(str(a.get(k)) for k in ("device_bytes", "allocated_bytes",
                     "host_anon_bytes_after", "host_anon_bytes_peak", "file_bytes", "layers")) + " |")
    return lines + [""]


def merge(paths: list[Path], out: Path, stem: str) -> dict:
    sources = merging.load(paths)
    raws = [x.record for x in sources]
    rec = merging.merged("lora", sources, {
        "date": raws[0]["date"], "device": raws[0]["device"], "dry_run": any(r.get("dry_run") for r in raws),
        "commands": [(r.get("provenance") or {}).get("command") or r.get("command") for r in raws], "models": {}})
    for r in raws:  # a model measured over several calls: each step from the call that ran it
        for key, m in r["models"].items():
            into = rec["models"].setdefault(key, {})
            into.update({k: v for k, v in m.items() if k not in into or not (isinstance(v, dict) and "skipped" in v)})
    rec["summary"] = summarize(rec)
    records.write(rec, out / f"{stem}.json", markdown(rec))
    return rec


