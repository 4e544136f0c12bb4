"""`dlo fetch URI DEST`: a resumable, verified download of a diffusers pipeline folder (or, with
`--kind lora`, of a folder of LoRA adapters).

Owns: the flags (the deadline and the stall bound among them), the progress renderer choice, the
result file (the fetch Job's termination message) and the exit codes: 0 complete, 2 bad input or a
source that is not a diffusers pipeline (with `--kind lora`: no adapter at its top; nothing at DEST),
1 any other failure (one line naming the reason; a rerun resumes).
Must never: import torch, or take a credential from the command line (boto3 reads AWS_*,
huggingface_hub reads HF_TOKEN).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from dlo.cli.args import (Parser, byte_size, http_url, non_negative_seconds, one_line, positive_int,
                          positive_seconds)
from dlo.cli.logs import add_log_format_argument, configure_logging, log_lines, say
from dlo.delivery.deadline import DEFAULT_DEADLINE_S, DEFAULT_MIN_RATE_BPS, DEFAULT_STALL_WINDOW_S
from dlo.delivery.uri import FETCH_KINDS

DESCRIPTION = """Download a diffusers pipeline folder from S3 or the Hugging Face Hub into DEST:
ranged, parallel and resumable (a rerun after an interruption continues where it stopped), every
file checked against its size and checksum (S3 ETags, multipart ones too; Hugging Face SHA-256 and
git hashes), published atomically (DEST appears only when the whole pipeline is there). A second
fetch of a complete DEST downloads nothing. Credentials come from the environment only:
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN, AWS_REGION) for S3, HF_TOKEN for
the Hub; HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE are honoured, and a revision already in the local
Hugging Face cache is copied from it with no network. With --kind lora the source is a folder of LoRA
adapters instead (NAME.safetensors files or NAME/ folders, what dlo serve --lora-dir loads)."""

EPILOG = """examples:
  dlo fetch s3://models/wan2.1-t2v-14b /data/models/wan2.1-t2v-14b --endpoint http://minio:9000
  dlo fetch hf://Wan-AI/Wan2.1-T2V-14B-Diffusers /data/models/wan --revision main
  dlo fetch s3://adapters/wan /data/lora/wan --kind lora
exit codes: 0 complete; 2 bad input, or not a diffusers pipeline (--kind lora: no adapter; nothing left at
DEST); 1 a failure
(credentials, network, disk: the message names it; run again to resume)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("uri", help="s3://bucket/prefix or hf://org/name[@revision]")
    parser.add_argument("dest", type=Path, help="the folder to create (it must not exist, or be this fetch's)")
    parser.add_argument("--revision", default=None, help="Hugging Face branch, tag or commit (default main)")
    parser.add_argument("--kind", choices=FETCH_KINDS, default="pipeline",
                        help="what the source is: a diffusers pipeline (default), or lora: a folder of LoRA "
                             "adapters (NAME.safetensors files or NAME/ folders, as dlo serve --lora-dir takes)")
    parser.add_argument("--endpoint", type=http_url, default=None,
                        help="an S3-compatible store's URL, or a Hugging Face mirror (default: AWS, or HF_ENDPOINT)")
    parser.add_argument("--concurrency", type=positive_int, default=8, help="parallel transfers (default 8)")
    parser.add_argument("--part-size", type=byte_size, default=16 * 2**20,
                        help="bytes per ranged S3 request (default 16MiB)")
    parser.add_argument("--keep", action="append", default=[], metavar="KEY",
                        help="a cached model (folder name beside DEST) in use on this node: never evicted "
                             "(repeatable)")
    parser.add_argument("--disk-budget", type=byte_size, default=None,
                        help="bytes the fetched models beside DEST may take; least recently served ones not "
                             "in use are evicted to fit (default: only the free space limits)")
    parser.add_argument("--no-evict", action="store_true",
                        help="never evict a cached model (a fetch that does not know which ones are in use)")
    parser.add_argument("--lock-wait", type=non_negative_seconds, default=600.0, metavar="SECONDS",
                        help="how long to wait for another fetch into DEST to end before failing (default 600)")
    parser.add_argument("--deadline", type=positive_seconds, default=DEFAULT_DEADLINE_S, metavar="SECONDS",
                        help=f"the whole fetch ends by then, failing `timeout` (default {DEFAULT_DEADLINE_S:g}: 6 h); a "
                             "rerun resumes")
    parser.add_argument("--min-rate", type=byte_size, default=DEFAULT_MIN_RATE_BPS, metavar="BYTES",
                        help="bytes a second a transfer must move over --stall-window, else it fails `timeout` "
                             "(default 16KiB)")
    parser.add_argument("--stall-window", type=positive_seconds, default=DEFAULT_STALL_WINDOW_S, metavar="SECONDS",
                        help=f"the window --min-rate is measured over (default {DEFAULT_STALL_WINDOW_S:g})")
    parser.add_argument("--progress", choices=("auto", "bar", "plain", "none"), default="auto",
                        help="auto: a bar on a terminal, plain progress lines when piped")
    parser.add_argument("--result-file", type=Path, default=None,
                        help="write the result as JSON here (a Job's /dev/termination-log)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    add_log_format_argument(parser)


def main(args: argparse.Namespace) -> int:
    from dlo.delivery.errors import FetchError, local_error
    from dlo.delivery.fetch import FetchOptions, FetchResult, fetch
    from dlo.delivery.uri import parse_uri

    configure_logging(args.log_format, os.environ.get("DLO_LOG_LEVEL", "INFO"))
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer", "huggingface_hub", "filelock", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    options = FetchOptions(endpoint=args.endpoint, concurrency=args.concurrency, part_size=args.part_size,
                           keep=frozenset(args.keep), disk_budget=args.disk_budget,
                           evict=not args.no_evict, lock_wait_s=args.lock_wait, deadline_s=args.deadline,
                           min_rate_bps=args.min_rate, stall_window_s=args.stall_window, kind=args.kind)
    progress = _progress(args)
    try:
        uri = parse_uri(args.uri, args.revision)
        result = fetch(uri, args.dest.absolute(), options, progress)
        code = 0
    except (FetchError, OSError) as error:
        e = error if isinstance(error, FetchError) else local_error(error, args.dest)
        result = FetchResult("failed", args.uri, str(args.dest), reason=e.reason, message=one_line(str(e)))
        say(f"dlo fetch: {e.reason}: {one_line(str(e))}", logging.ERROR)
        code = e.exit_code
    finally:
        progress.close()
    _report(args, result)
    if result.already_complete and not args.json:  # a fetch that downloads logs what it fetched; this one says so
        say(f"dlo fetch: {result.dest} is already complete ({result.files} files, {_size(result.bytes)} of "
            f"{result.uri}): nothing to download")
    if result.reason == "timeout":  # a transfer thread may still be blocked in a read: never wait for it
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _progress(args: argparse.Namespace) -> Any:
    """`--progress`; under JSON logs, its lines are records of `dlo.delivery.progress` (no bar): the
    operator reads the last one from the Job's log either way (`parse_progress_line`)."""
    from dlo.delivery.progress import PROGRESS_LOGGER, Progress

    stream = log_lines(PROGRESS_LOGGER) if args.progress != "none" else None
    return Progress(args.progress if stream is None else "plain", stream=stream)  # type: ignore[arg-type]


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


def _report(args: argparse.Namespace, result: object) -> None:
    text = json.dumps(result.to_json())  # type: ignore[attr-defined]
    if args.result_file is not None:
        try:
            args.result_file.write_text(text[:4096])  # the kubelet keeps at most 4096 bytes
        except OSError as e:
            say(f"dlo fetch: cannot write {args.result_file}: {e.strerror}", logging.WARNING)
    if args.json:
        print(text)


def run(command: str, argv: list[str]) -> int:
    parser = Parser(prog="dlo fetch", description=DESCRIPTION, epilog=EPILOG,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return main(parser.parse_args(argv))
