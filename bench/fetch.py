"""Model delivery: `dlo fetch` from an S3-compatible store, measured on loopback (moto's S3 server in
its own process, the real boto3 client), so the figures are the fetch path's own (ranged parallel
reads, the checksum of every part and file, the atomic publish), never a network's.

    python -m bench fetch [--mib 512] [--fetches 3] --out bench/results --stem fetch-DATE

The model: a Wan pipeline of random weights of about `--mib` MiB (`dlo make-tiny-model`), uploaded
with multipart objects. Figures: each whole fetch's seconds (the first apart, median, min, max)
and MB/s; a second fetch of a complete folder (nothing downloaded); a fetch killed part way and run
again (the bytes it did not fetch again). CPU only: what limits it here is moto and this host.
Must never: reach a network beyond loopback, or keep its folders (a temporary folder, removed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.lib import records
from bench.lib.stats import spread, text
from tests.delivery.conftest import S3Server, start_moto, upload


def _fetch(server: S3Server, dest: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dlo.cli.main", "fetch", "s3://bench/model", str(dest), "--endpoint", server.url,
            "--json", "--progress", "none", *extra]


def _run(server: S3Server, dest: Path, *extra: str) -> tuple[float, dict[str, Any]]:
    t0 = time.perf_counter()
    proc = subprocess.run(_fetch(server, dest, *extra), env=server.env(), capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"dlo fetch failed: {proc.stderr[-1000:]}")
    return seconds, json.loads(proc.stdout.strip().splitlines()[-1])


def _done_bytes(dest: Path) -> int:
    """The bytes the fetch into `dest` has recorded as written (its staging folder's state)."""
    from dlo.delivery.staging import STATE, staging_dir

    try:
        files = json.loads((staging_dir(dest) / STATE).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return 0
    return sum(min(f["part_size"], f["size"] - i * f["part_size"]) for f in files.values() for i in f["done"])


def _killed_and_resumed(server: S3Server, dest: Path, total: int) -> dict[str, Any]:
    """A fetch killed once it has written about 40% of the bytes, then run again."""
    slow = ("--concurrency", "2", "--part-size", "4MiB")  # the same options again: the same parts resume
    proc = subprocess.Popen(_fetch(server, dest, *slow), env=server.env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while proc.poll() is None and _done_bytes(dest) < 0.4 * total and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    held = _done_bytes(dest)
    seconds, result = _run(server, dest, *slow)
    return {"killed_with_written_bytes": held, "rerun_seconds": round(seconds, 2),
            "rerun_downloaded_bytes": result.get("downloaded_bytes"), "bytes": result.get("bytes")}


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    model = work / "model"
    layers = max(1, args.mib // 54)  # a Wan block at dim 1024: ~54 MiB in float32
    subprocess.run([sys.executable, "-m", "dlo.cli.main", "make-tiny-model", str(model), "--family", "wan",
                    "--layers", str(layers), "--dim", "1024"], check=True, capture_output=True)
    total = sum(p.stat().st_size for p in model.rglob("*") if p.is_file())
    server = start_moto()
    try:
        upload(server.client(), model, "bench", "model", part_size=16 * 2**20)
        runs = []
        for i in range(args.fetches):
            dest = work / f"dest-{i}" / "model"
            runs.append(_run(server, dest))
        again, again_result = _run(server, work / "dest-0" / "model")
        resumed = _killed_and_resumed(server, work / "dest-resume" / "model", total)
    finally:
        server.process.terminate()
        server.process.wait(timeout=30)
    seconds = spread([s for s, _ in runs])
    return {"model_bytes": total, "layers": layers, "fetches": args.fetches, "fetch_seconds": seconds,
            "fetch_mb_per_second": spread([total / s / 1e6 for s, _ in runs]),
            "downloaded_bytes": [r.get("downloaded_bytes") for _, r in runs],
            "complete_again": {"seconds": round(again, 2), "downloaded_bytes": again_result.get("downloaded_bytes"),
                               "already_complete": again_result.get("already_complete")},
            "killed_and_resumed": resumed}


def markdown(rec: dict[str, Any]) -> str:
    r = rec["killed_and_resumed"]
    return "\n".join([
        f"# dlo fetch from an S3-compatible store on loopback ({rec['provenance']['date'][:10]})", "",
        f"Command: `{rec['provenance']['command']}`; card: {rec['provenance']['card']['name']} (CPU only: moto's "
        "server and this host bound the figures, not a network).", "",
        f"- model: {rec['model_bytes'] / 1e6:,.0f} MB (Wan pipeline, random weights, multipart objects)",
        f"- a whole fetch: {text(rec['fetch_seconds'], ' s', digits=2)}; "
        f"{text(rec['fetch_mb_per_second'], ' MB/s')}",
        f"- the same folder again: {rec['complete_again']['seconds']} s, "
        f"{rec['complete_again']['downloaded_bytes']} bytes downloaded",
        f"- killed with {r['killed_with_written_bytes'] / 1e6:,.0f} MB written, then run again: {r['rerun_seconds']} s, "
        f"{r['rerun_downloaded_bytes'] / 1e6:,.0f} of {r['bytes'] / 1e6:,.0f} MB downloaded", ""])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench fetch", description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="about how large the model is")
    ap.add_argument("--fetches", type=int, default=3, help="whole fetches timed")
    ap.add_argument("--out", type=Path, default=Path("bench/results"), help="folder of the record")
    ap.add_argument("--stem", default=None, help="record name (default fetch-cpu-<date>)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dlo-bench-fetch-"))
    try:
        rec = records.raw("fetch", "cpu", measure(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stem = args.stem or f"fetch-cpu-{rec['provenance']['date'][:10]}"
    records.write(rec, args.out / f"{stem}.json", markdown(rec))
    print(markdown(rec))
    return 0
