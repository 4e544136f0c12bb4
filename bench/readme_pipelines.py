"""The README's figures of whole pipelines served: full size against plain diffusers, the published
system's own models, small cards, FP8, LoRA, CFG pairs, model delivery and start-up.

Owns: one `Topic` function each (`TOPICS`), over the newest records of their kind (see
`bench.readme_figures`). Served and diffusers requests of one call are compared median to median
and first request to first request; a served request tried twice counts its first try.
Must never: keep the best of several tries, or compare runs of different calls.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from bench.lib.stats import ratio, spread, text
from bench.readme_figures import Topic, latest, newest, secs, x

SIDE = ("served", "plain diffusers", "served over diffusers")


def _requests(run: dict[str, Any]) -> dict[str, Any] | None:
    """A pipeline run's request seconds, the first request first."""
    samples = run.get("request_seconds")
    return spread(samples) if samples else None


def _pair(models: dict, model: str, served: str, base: str) -> tuple[str, ...] | None:
    a, b = models.get(model, {}).get(served, {}), models.get(model, {}).get(base, {})
    sa, sb = _requests(a), _requests(b)
    if not (sa and sb) or a.get("source") != b.get("source"):
        return None
    return (secs(sa), secs(sb), x(ratio(sa, sb)))


def _merged(*globs: str) -> tuple[Path, dict]:
    path = latest(*globs)
    return path, json.loads(path.read_text())


def pipelines() -> Topic:
    path, rec = _merged("pipeline-h200-*.json", "pipeline-20*.json")
    rows = []
    for model, label in (("wan21", "Wan2.1-T2V-14B, 832x480x17, 10 steps"), ("flux", "Flux.1-dev, 1024x1024, 20 steps")):
        got = _pair(rec["models"], model, "serve_rank_local_partial", "diffusers_resident")
        if got:
            rows.append((label, *got))
    return Topic("pipelines", "Full-size pipelines on one card: `dlo serve` streaming part of each transformer "
                 "against the same pipeline resident in plain diffusers (one call each)", ("", *SIDE),
                 tuple(rows), (path.name,))


def _first_tries(run: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """A seed-model run's requests of one kind: a served request tried twice counts its first try."""
    xs = [(r.get("tries_seconds") or [r["seconds"]])[0] for r in run["requests"] if r.get("kind") == kind]
    return spread(xs) if xs else None


def families() -> Topic:
    files = newest("raw-seed-models-*-cosmos3-nano.json", "seed-models-cosmos3-nano-*-raw.json")
    files += [p for p in newest("raw-seed-models-*-minimax-h3.json", "seed-models-minimax-h3-*-raw.json") if p not in files]
    rows = []
    for p in files:
        rec = json.loads(p.read_text())
        runs = rec["runs"]
        for kind in ("video", "image"):
            a, b = (_first_tries(runs[n], kind) if n in runs else None for n in ("serve_rank_local", "diffusers_resident"))
            if a and b:
                rows.append((f"{rec['model']}, {kind}", secs(a), secs(b), x(ratio(a, b))))
    return Topic("families", "The published system's own models (Cosmos3-Nano, MiniMax-H3): `dlo serve` rank-local "
                 "against plain diffusers resident, the served side's first tries only", ("", *SIDE), tuple(rows),
                 tuple(p.name for p in files))


def small_cards() -> Topic:
    path, rec = _merged("small-gpu-h200-*.json", "small-gpu-20*.json")
    rows = []
    for model in ("wan21", "wan21i2v", "flux", "qwen"):
        got = _pair(rec["models"], model, "serve_default_capped_24gib", "diffusers_group_offload_capped_24gib")
        if got:
            peak = max(rec["models"][model]["serve_default_capped_24gib"]["peak_device_bytes"].values())
            rows.append((model, *got, f"{peak / 2**30:.1f} GiB"))
    return Topic("small-cards", "Small cards: every pipeline under a 24 GiB cap (`--max-device-memory 24GiB`, the "
                 "default mode) against diffusers' group offloading (leaf level, stream) under the same cap",
                 ("", "served", "diffusers offloading", "served over diffusers", "served peak"), tuple(rows),
                 (path.name,))


def fp8() -> Topic:
    path, rec = _merged("small-gpu-h200-*.json", "small-gpu-20*.json")
    flux = rec["models"]["flux"]
    got = _pair(rec["models"], "flux", "serve_capped_24gib_zero_resident_fp8", "serve_capped_24gib_zero_resident")
    drift = flux.get("fp8_drift") or {}
    rows = [("Flux.1-dev 1024x1024, every block streamed under 24 GiB", *(got or ("", "", "")),
             f"{drift.get('psnr_db')} dB PSNR, {drift.get('max_abs_levels')} levels at most")]
    return Topic("fp8", "FP8 streaming (`dlo quantize`, then `--stream-dtype fp8`) against bfloat16, same call",
                 ("", "FP8", "bfloat16", "FP8 over bfloat16", "drift from bfloat16 (random weights)"),
                 tuple(rows), (path.name,))


def _base_lora(run: dict[str, Any], kind: str) -> dict[str, Any]:
    return spread(run["request_seconds"][kind])


def lora() -> Topic:
    path, rec = _merged("lora-h1*-*-final.json")
    rows = []
    for model, run in (("wan21", "serve_rank_local_auto"), ("flux", "serve_rank_local_auto"),
                       ("wan21", "serve_resident_auto")):
        r = rec["models"].get(model, {}).get(run)
        if r and "request_seconds" in r:
            a, b = _base_lora(r, "lora"), _base_lora(r, "base")
            rows.append((f"{model}, {run.removeprefix('serve_').removesuffix('_auto')}", secs(a), secs(b), x(ratio(a, b))))
    return Topic("lora", "A rank-64 LoRA adapter per request (`--lora-dir`, the default merge) against the same "
                 "request without one, same server", ("", "with the adapter", "without", "ratio"), tuple(rows),
                 (path.name,))


def cfg_pairs() -> Topic:
    files = newest("raw-lora-*-wan21-default-pairs.json")
    files += newest("raw-small-gpu-*-qwen-pairs.json")
    rows = []
    for p in files:
        rec = json.loads(p.read_text())
        for model, v in rec["models"].items():
            for paired, unpaired in (("serve_rank_local_auto", "serve_rank_local_unpaired_auto"),
                                     ("serve_capped_24gib_zero_resident", "serve_capped_24gib_zero_resident_unpaired")):
                if paired in v and unpaired in v:
                    pick = (lambda r: spread(r["request_seconds"]["base"])) if isinstance(
                        v[paired]["request_seconds"], dict) else (lambda r: spread(r["request_seconds"]))
                    a, b = pick(v[paired]), pick(v[unpaired])
                    rows.append((f"{model}, every block streamed", secs(a), secs(b), x(ratio(a, b))))
    return Topic("cfg-pairs", "CFG pairs: a step's cond and uncond calls walk the streamed blocks together (the "
                 "default) against one after the other (`--no-cfg-pairs`), same call",
                 ("", "paired", "unpaired", "paired over unpaired"), tuple(rows), tuple(p.name for p in files))


def delivery() -> Topic:
    path = latest("fetch-*.json")
    rec = json.loads(path.read_text())
    r = rec["killed_and_resumed"]
    rows = [("a whole fetch", secs(rec["fetch_seconds"]), text(rec["fetch_mb_per_second"], " MB/s")),
            ("the same folder again", f"{rec['complete_again']['seconds']} s",
             f"{rec['complete_again']['downloaded_bytes']} bytes downloaded"),
            ("killed part way, run again", f"{r['rerun_seconds']} s",
             f"{r['rerun_downloaded_bytes'] / 1e6:,.0f} of {r['bytes'] / 1e6:,.0f} MB downloaded")]
    return Topic("delivery", f"Model delivery: `dlo fetch` of a {rec['model_bytes'] / 1e6:,.0f} MB pipeline from an "
                 "S3-compatible store on loopback (the fetch path's own cost, no network)", ("", "seconds", "what moved"),
                 tuple(rows), (path.name,))


def startup() -> Topic:
    path, rec = _merged("ready-h200-*.json", "startup-20*.json")
    raw = rec["raws"][0]
    rows = []
    for mode in ("resident", "rank-local"):
        warm = [s["ready_seconds"] for s in raw["starts"] if s["mode"] == mode and not s.get("cold")
                and not s.get("profiled") and s.get("ready_seconds")]
        if warm:
            rows.append((f"Wan2.1-T2V-14B, {mode}, warm page cache", secs(spread(warm))))
    absent = ", ".join(raw.get("optional_packages") or []) or "none"
    return Topic("startup", "Start-up: seconds from process start to `/ready` (warm-up included)", ("", "seconds"),
                 tuple(rows), (path.name,),
                 f"Measured before the committed lock: the device's own environment with scipy, scikit-learn, pandas, "
                 f"torchvision, onnxruntime and peft uninstalled and bytecode compiled (optional packages present: "
                 f"{absent}); the image's own start-up is measured with `bash bench/device.sh python -m bench startup`.")


def tests() -> Topic:
    path = latest("tests-*.json")
    rec = json.loads(path.read_text())
    rows = [("every test (`make test`, what CI runs)", f"{rec['collected']['all']:,}",
             "; ".join(f"{r['minutes']} minutes reported ({r['where']})" for r in rec["full_reported"]))]
    for name, label in (("full", "every test, measured here"), ("quick", "the quick subset (`make test-quick`)")):
        r = rec["runs"].get(name)
        count = rec["collected"]["all" if name == "full" else "quick"]
        if r:
            rows.append((label, f"{count:,}", f"{r['wall_seconds'] / 60:.1f} minutes on {r['cpus']} CPUs (load "
                         f"{r['load_average_before']} at its start): {r['outcome']}"))
    return Topic("tests", "Tests: how many, and how long on a 2-core machine", ("", "tests", "wall time"),
                 tuple(rows), (path.name,))


TOPICS: list[Callable[[], Topic]] = [pipelines, families, small_cards, fp8, lora, cfg_pairs, delivery, startup, tests]
