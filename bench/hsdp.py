"""HSDP (FSDP2 + Ulysses), the published system's multi-GPU baseline, against DLO on N GPUs (issue 33).

One device call = one `run` on a node of N >= 2 GPUs (with the lock's wheel set `.whl`; timeout
540 s), inside 8 minutes at 40 Wan2.1-14B layers (predicted ~4 min on two H200s: checkpoint ~45 s,
four phases ~35-50 s each; `--budget-s` 450 skips what would not fit). One file comes back through
$OUT, the raw JSON:

    bash bench/device.sh python -m bench hsdp run --layers 40 --raw $OUT/raw-hsdp.json

    python -m bench hsdp merge bench/results/raw-hsdp-<date>.json --date <date>  # -> hsdp-<N>x-<date>.{json,md}
    python -m bench hsdp run --dry-run --raw /tmp/raw-hsdp.json    # CPU ranks, gloo, tiny Wan (tests/test_bench_hsdp.py)

`run` writes the seeded checkpoint once (bench/wan_bench.py), then ONE process group of N ranks
(one per device) runs four phases in order, each loading its engine from that checkpoint, timing its
runs and freeing the device before the next (bench/hsdp_ranks.py):
- `reference`: the resident model on rank 0 alone; its seed-1 outputs are what the others match;
- `hsdp`: FSDP2 (`fully_shard` per block and on the root over a 1-D mesh of all N ranks, reshard
  after forward, the stored bf16/fp32 dtypes under FSDP2's default MixedPrecisionPolicy, each block
  prefetching the next with `set_modules_to_forward_prefetch`; [Note: HSDP + Ulysses] in
  hsdp_ranks.py), first as a wave (sp 1, each rank its own request: `<w>/dp/b1`), then with
  diffusers' Ulysses over the same N ranks at batches `--hsdp-batches` (`<w>/sp/b<B>`);
- `dlo_allgather`, `dlo_ranklocal`: dlo.engine.load in that mode, a wave of N requests
  (`<w>/dp/b1`), then DLO's Ulysses (`--dlo-exchange`) over the same N ranks (`<w>/sp/b1`).
A group that dies in a phase records that phase's error and the rest run in a fresh group; a phase
that the call's budget (`--budget-s`) cannot hold is skipped and said so.
Per run: seconds per call (median after a warm-up; the slowest rank's), requests per call, peak
device memory per rank (torch's allocator), DLO's wait for weights; per phase: load seconds and
each rank's smaps_rollup after load and after the runs (host memory per node = the ranks' Pss);
every run's seed-1 output against the reference's. HSDP's stated tolerance (`HSDP_TOLERANCE`):
bit-identical at batch 1; at batch > 1 sample 0 is compared and its difference reported.
Workloads: image-like 4,096 tokens, 480p video 32,760 tokens (`--dry-run`: tiny Wan, 64/192).
Summary: `dlo_over_hsdp_video_sp` (goal <= 1.03), `dlo_seconds_per_request_over_hsdp_image_waves`
(DLO's wave against HSDP's best image run per request; goal <= 0.72), `dlo_device_memory_over_hsdp`
(peak per rank, video with sp; goal <= 0.5). NVLink multicast stays off for every process (_env.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

from bench import _env

_env.multicast_off()  # before torch is imported, here and in every rank spawned from here
from bench import hsdp_ranks as hr
from bench import ranks as br
from bench import wan_bench as wb
from bench.lib import merge as merging
from bench.lib import records

GOALS = {"dlo_over_hsdp_video_sp": 1.03, "dlo_seconds_per_request_over_hsdp_image_waves": 0.72,
         "dlo_device_memory_over_hsdp": 0.5}
# HSDP's outputs against the resident reference: batch 1 must be bit-identical; a batch may move
# sample 0 by bf16 roundings (its GEMMs have other shapes, so kernels may sum in another order).
HSDP_BATCHED_MIN_PSNR_DB = 40.0
HSDP_TOLERANCE = ("bit-identical at batch 1 (the all-gather moves the stored bytes, every GEMM sees the reference's "
                  "operands, diffusers' Ulysses is bit-identical to one GPU); at batch > 1 sample 0 against the "
                  f"batch-1 reference, bit-identical or PSNR >= {HSDP_BATCHED_MIN_PSNR_DB:.0f} dB (the GEMMs' shapes "
                  "change with the batch)")
VIDEO_SP = "video/sp/b1"


def run(args: argparse.Namespace) -> None:
    t_start = time.time()
    import torch

    if args.dry_run:
        args.device, args.tiny, args.layers = "cpu", True, args.layers or 3
    world = args.ranks or (torch.cuda.device_count() if args.device == "cuda" else 2)
    if world < 2 or (args.device == "cuda" and world > torch.cuda.device_count()):
        raise SystemExit(f"needs 2 or more ranks with a device each: --ranks {world}, "
                         f"{torch.cuda.device_count() if args.device == 'cuda' else 'cpu'} devices")
    args.deadline = t_start + args.budget_s
    ckpt, written, facts = wb.checkpoint_for(args.ckpt, args.layers, args.device, args.tiny)
    args.ckpt = str(ckpt)
    print(f"checkpoint {ckpt}: {facts.bytes / 1e9:.2f} GB ({time.time() - t_start:.0f} s); {world} ranks", flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    for old in [*args.work.glob("phase-*.json"), *args.work.glob("out-*.pt")]:
        old.unlink()
    rec: dict = records.raw("hsdp", args.device, {
        "layers": args.layers, "ranks": world, "tiny": args.tiny, "device": args.device, "model_bytes": facts.bytes,
        "block_bytes": facts.largest_block_bytes, "nonblock_bytes": facts.nonblock_bytes, "checkpoint": written,
        "dlo_exchange": args.dlo_exchange, "hsdp_batches": args.hsdp_batches, "hsdp_tolerance": HSDP_TOLERANCE,
        "environment": _env.MULTICAST_OFF, "work": str(args.work)})
    rec["phases"] = run_phases(args, world)
    rec["outputs"] = compare_phases(rec["phases"], args.work)
    rec["seconds"] = time.time() - t_start
    rec["summary"] = summarize(rec)
    records.write(rec, Path(args.raw))
    print(json.dumps({k: rec["summary"][k] for k in (*GOALS, "goals_met", "failed", "skipped")}, indent=1, default=str))
    print(f"wrote {args.raw} ({rec['seconds']:.0f} s in all)")


def run_phases(args: argparse.Namespace, world: int) -> dict:
    """The phases in one group; when the group dies, the phase it died in records the error and
    the phases after it run in a fresh group (a failed phase is a result too)."""
    results: dict = {}
    todo = [p for p in hr.PHASES if p in args.phases.split(",")]
    args.longest_phase_s = 0.0  # the budget check's estimate of a phase, carried into a fresh group
    while todo:
        error, t0 = None, time.perf_counter()
        try:
            br.spawn(hr.rank_main, world, args, todo, str(args.work))
        except Exception as e:
            error = f"{type(e).__name__}: {e}"[-800:]
        done = 0.0  # seconds of this group's completed phases
        while todo and (args.work / f"phase-{todo[0]}.json").exists():
            name = todo.pop(0)
            results[name] = json.loads((args.work / f"phase-{name}.json").read_text())
            took = max((r["seconds"] for r in results[name]), default=0.0) if isinstance(results[name], list) else 0.0
            done, args.longest_phase_s = done + took, max(args.longest_phase_s, took)
        if todo:
            name = todo.pop(0)
            results[name] = {"error": error or "the group ended without this phase's result"}
            args.longest_phase_s = max(args.longest_phase_s, time.perf_counter() - t0 - done)
            print(f"[{name}] failed: {results[name]['error'][-300:]}", flush=True)
    return results


def compare_phases(phases: dict, work: Path) -> dict:
    """Each run's seed-1 output (rank 0's sample 0) against the reference's, per phase and run."""
    import torch

    out: dict = {}
    for phase, res in phases.items():
        if phase == "reference" or not isinstance(res, list):
            continue
        for key in res[0]["runs"]:
            ref = work / f"out-reference-{key.split('/')[0]}-one-b1.pt"
            got = work / f"out-{phase}-{key.replace('/', '-')}.pt"
            if ref.exists() and got.exists():
                out.setdefault(phase, {})[key] = wb.compare_outputs(torch.load(ref), torch.load(got))
    return out


# ---- the summary (also what `merge` writes) ------------------------------------------------------
def _runs(rec: dict, phase: str) -> list | None:
    r = rec["phases"].get(phase)
    return r if isinstance(r, list) else None


def _secs(rec: dict, phase: str, key: str) -> float | None:
    r = _runs(rec, phase)
    if r is None or key not in r[0]["runs"]:
        return None
    return max(x["runs"][key]["seconds"] for x in r)  # the slowest rank ends the call


def _per_request(rec: dict, phase: str, key: str) -> float | None:
    s = _secs(rec, phase, key)
    return None if s is None else s / _runs(rec, phase)[0]["runs"][key]["requests"]


def _peak(rec: dict, phase: str, key: str) -> int | None:
    r = _runs(rec, phase)
    if r is None or key not in r[0]["runs"] or r[0]["runs"][key]["peak_device_bytes"] is None:
        return None
    return max(x["runs"][key]["peak_device_bytes"] for x in r)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _host_per_node(r: list) -> dict:
    """The ranks' smaps_rollup summed (one node): before the phase's load (what earlier phases and
    the imports left), after it, and after the runs."""
    return {when: {k: sum(x[when].get(k, 0) for x in r) for k in ("Pss", "Pss_Anon", "Pss_File", "Rss")}
            for when in ("host_start", "host_loaded", "host_end")}


def _best_hsdp_image(rec: dict) -> tuple[str | None, float | None]:
    r = _runs(rec, "hsdp")
    cands = {k: _per_request(rec, "hsdp", k) for k in (r[0]["runs"] if r else {}) if k.startswith("image/")}
    if not cands:
        return None, None
    key = min(cands, key=cands.__getitem__)
    return key, cands[key]


def summarize(rec: dict) -> dict:
    keys = {p: list(r[0]["runs"]) for p in rec["phases"] if (r := _runs(rec, p))}
    s: dict = {"seconds_per_call": {p: {k: _secs(rec, p, k) for k in ks} for p, ks in keys.items()},
               "seconds_per_request": {p: {k: _per_request(rec, p, k) for k in ks} for p, ks in keys.items()},
               "peak_device_bytes_per_rank": {p: {k: [x["runs"][k]["peak_device_bytes"] for x in _runs(rec, p)]
                                                  for k in ks} for p, ks in keys.items()}}
    hsdp_video = _secs(rec, "hsdp", VIDEO_SP)
    best_key, best = _best_hsdp_image(rec)
    s["hsdp_best_image"] = {"run": best_key, "seconds_per_request": best}
    for phase, label in (("dlo_allgather", "dlo"), ("dlo_ranklocal", "dlo_ranklocal")):
        s[f"{label}_over_hsdp_video_sp"] = _ratio(_secs(rec, phase, VIDEO_SP), hsdp_video)
        s[f"{label}_seconds_per_request_over_hsdp_image_waves"] = _ratio(_per_request(rec, phase, "image/dp/b1"), best)
        s[f"{label}_seconds_per_request_over_hsdp_image_batch1"] = _ratio(_per_request(rec, phase, "image/dp/b1"),
                                                                         _per_request(rec, "hsdp", "image/sp/b1"))
        s[f"{label}_device_memory_over_hsdp"] = _ratio(_peak(rec, phase, VIDEO_SP), _peak(rec, "hsdp", VIDEO_SP))
    s["hsdp_over_one_gpu_video_sp"] = _ratio(hsdp_video, _secs(rec, "reference", "video/one/b1"))
    s["goals_met"] = {k: (None if s[k] is None else s[k] <= g) for k, g in GOALS.items()}
    s["host_bytes_per_node"] = {p: _host_per_node(r) for p in keys if (r := _runs(rec, p))}
    outs = rec.get("outputs") or {}
    s["dlo_bit_identical"] = _all_identical(outs, ("dlo_allgather", "dlo_ranklocal"), lambda k: True)
    s["hsdp_bit_identical_batch1"] = _all_identical(outs, ("hsdp",), lambda k: k.endswith("/b1"))
    s["hsdp_batched_vs_reference"] = {k: c for k, c in (outs.get("hsdp") or {}).items() if not k.endswith("/b1")}
    s["hsdp_within_tolerance"] = (None if s["hsdp_bit_identical_batch1"] is None else s["hsdp_bit_identical_batch1"]
                                  and all(c.get("bit_identical") or (c.get("psnr_db") or 0) >= HSDP_BATCHED_MIN_PSNR_DB
                                          for c in s["hsdp_batched_vs_reference"].values()))
    s["failed"] = {p: r["error"] for p, r in rec["phases"].items() if isinstance(r, dict) and "error" in r}
    s["skipped"] = {p: r["skipped"] for p, r in rec["phases"].items() if isinstance(r, dict) and "skipped" in r}
    return s


def _all_identical(outs: dict, phases: tuple, keep) -> bool | None:
    found = [c.get("bit_identical") for p in phases for k, c in (outs.get(p) or {}).items() if keep(k)]
    return all(found) if found else None


def merge(args: argparse.Namespace) -> int:
    sources = merging.load(args.raw_files)
    first = sources[0].record
    body = {k: v for k, v in first.items() if k not in ("provenance", "suite", "kind")}
    body["device_name"] = merging.one_card(sources)
    for r in (x.record for x in sources[1:]):  # a later call's completed phases fill what an earlier one lacks
        for p, v in r["phases"].items():
            if not isinstance(body["phases"].get(p), list) and isinstance(v, list):
                body["phases"][p] = v
                body["outputs"][p] = (r.get("outputs") or {}).get(p, {})
    rec = merging.merged("hsdp", sources, body)
    rec["summary"] = summarize(rec)
    tag = args.tag or f"hsdp-{rec['ranks']}x-{args.date}"
    md = _markdown(rec, args, tag)
    records.write(rec, Path(args.out) / f"{tag}.json", md)
    print(md)
    return 0


def _gb(x: float | None) -> str:
    return "" if x is None else f"{x / 1e9:.2f}"


def _markdown(rec: dict, args: argparse.Namespace, tag: str) -> str:
    s = rec["summary"]
    lines = [f"# {rec['ranks']} x {rec['device_name']}: HSDP (FSDP2 + Ulysses) against DLO, {rec['layers']} "
             "Wan2.1-14B layers", "",
             f"Merged with `python -m bench hsdp merge {' '.join(args.raw_files)}` into `{tag}`; each raw file is "
             f"one device call (`run` command inside). DLO's Ulysses exchange: {rec['dlo_exchange']}; HSDP's: "
             f"diffusers'. HSDP's tolerance: {rec['hsdp_tolerance']}.", "",
             "| phase | run | ms per call | requests | ms per request | peak device GB per rank | vs reference |",
             "|---|---|---|---|---|---|---|"]
    for p, per in s["seconds_per_call"].items():
        for k, t in per.items():
            c = (rec.get("outputs") or {}).get(p, {}).get(k)
            cmp = "" if c is None else ("bit-identical" if c.get("bit_identical") else
                                        f"max abs {c.get('max_abs_diff'):.3g}, PSNR {c.get('psnr_db'):.1f} dB")
            per_rank = s["peak_device_bytes_per_rank"][p][k]
            peaks = ", ".join(_gb(x) for x in per_rank) if any(x is not None for x in per_rank) else ""
            lines.append(f"| {p} | {k} | {t * 1e3:.1f} | {_runs(rec, p)[0]['runs'][k]['requests']} | "
                         f"{s['seconds_per_request'][p][k] * 1e3:.1f} | {peaks} | {cmp} |")
    lines += [""]
    for k in (*GOALS, "goals_met", "hsdp_best_image", "dlo_ranklocal_over_hsdp_video_sp",
              "dlo_ranklocal_seconds_per_request_over_hsdp_image_waves",
              "dlo_seconds_per_request_over_hsdp_image_batch1",
              "dlo_ranklocal_device_memory_over_hsdp", "hsdp_over_one_gpu_video_sp", "dlo_bit_identical",
              "hsdp_bit_identical_batch1", "hsdp_batched_vs_reference", "hsdp_within_tolerance", "failed", "skipped"):
        lines.append(f"- `{k}`: {s.get(k)}")
    lines += ["", "Host memory per node (the ranks' smaps_rollup summed, GB; before the load, after it, after the "
              "runs):", ""]
    for p, h in s["host_bytes_per_node"].items():
        lines.append(f"- {p}: " + "; ".join(f"{when.removeprefix('host_')}: " + ", ".join(
            f"{k} {_gb(v)}" for k, v in h[when].items()) for when in h))
    return "\n".join(lines) + "\n"


def _phases(text: str) -> str:
    unknown = sorted(set(text.split(",")) - set(hr.PHASES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown phase {unknown[0]!r}: a comma list of {', '.join(hr.PHASES)}")
    return text


def _workloads(text: str) -> str:
    if not text or set(text.split(",")) - {"video", "image"}:
        raise argparse.ArgumentTypeError(f"a comma list of video, image; got {text!r}")
    return text


def _batches(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1 or 1 not in out:
        raise argparse.ArgumentTypeError(f"a comma list of batch sizes >= 1 including 1, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench hsdp", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one device call: checkpoint once, one process group for the four phases")
    r.add_argument("--layers", type=int, default=None, help="Wan2.1-14B layers (default 40; --dry-run 3)")
    r.add_argument("--ranks", type=int, default=None, help="ranks (default: every visible GPU; 2 on cpu)")
    r.add_argument("--phases", type=_phases, default=",".join(hr.PHASES), help=f"comma list of {', '.join(hr.PHASES)}")
    r.add_argument("--workloads", type=_workloads, default="video,image", help="video (32,760 tokens), image (4,096)")
    r.add_argument("--hsdp-batches", type=_batches, default=[1, 2, 4],
                   help="HSDP+Ulysses image batch sizes (default 1,2,4)")
    r.add_argument("--dlo-exchange", default="overlap", choices=("overlap", "lean", "diffusers"),
                   help="DLO's Ulysses exchange (default overlap, the engine's; diffusers: HSDP's own)")
    r.add_argument("--budget-s", type=float, default=450.0, help="the call's budget: later phases are skipped past it")
    r.add_argument("--phase-limit-s", type=float, default=180.0,
                   help="a phase longer than this dumps its stacks and ends the group")
    r.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    r.add_argument("--tiny", action="store_true", help="tiny dimensions")
    r.add_argument("--dry-run", action="store_true", help="CPU ranks with gloo, tiny Wan, 3 layers, 2 timed calls")
    r.add_argument("--ckpt", default=None)
    r.add_argument("--work", type=Path, default=Path("/tmp/dlo-hsdp"), help="phase results and outputs (emptied first)")
    r.add_argument("--raw", required=True, help="raw JSON to write")
    m = sub.add_parser("merge", help="raw files of one card -> bench/results/hsdp-<N>x-<date>.{json,md}")
    m.add_argument("raw_files", nargs="+")
    m.add_argument("--date", default=datetime.date.today().isoformat())
    m.add_argument("--tag", default=None, help="record name (default hsdp-<ranks>x-<date>)")
    m.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        args.layers = args.layers or (None if args.dry_run else 40)
        run(args)
        return 0
    return merge(args)


if __name__ == "__main__":
    raise SystemExit(main())
