"""One fetch, as named steps: list the source, refuse what is not a diffusers pipeline (or, with
`kind` lora, not a folder of LoRA adapters), make room on the disk, download (resuming), check the
staged pipeline, publish atomically.

Owns: `FetchOptions`, `FetchResult`, `fetch` (the one implementation behind `dlo fetch`, `dlo serve
URI` and the operator's node fetch Jobs: one at a time on a DEST, within a deadline and a stall
bound (`dlo.delivery.deadline`), a disk or file error a one-line FetchError; the abandoned staging
folders of other DESTs reclaimed first) and `model_folder` / `serving_folder` (a URI as a folder
`dlo serve` can load, leased for as long as the server runs so no fetch evicts it).
Must never: leave anything at DEST but a complete, verified pipeline (or adapters' folder), evict a model in `keep` or in use, call
a published folder complete when a file of its manifest has another size, or import torch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dlo.cli.logs import log_lines
from dlo.delivery.adapters import check_adapters
from dlo.delivery.cache import cached_models, hold_lease, make_room, reclaim_stale_staging, touch_served
from dlo.delivery.deadline import DEFAULT_DEADLINE_S, DEFAULT_MIN_RATE_BPS, DEFAULT_STALL_WINDOW_S, Guard
from dlo.delivery.errors import FetchError, SourceRefused, local_error
from dlo.delivery.paths import path_under
from dlo.delivery.pipeline import SourceFile, check_pipeline, index_files, read_json_file
from dlo.delivery.progress import PROGRESS_LOGGER, Progress
from dlo.delivery.staging import Staging, dest_lock, published_manifest
from dlo.delivery.uri import FetchKind, ModelURI, cache_path, parse_uri

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FetchOptions:
    endpoint: str | None = None  # an S3-compatible store, or a Hugging Face mirror (else HF_ENDPOINT)
    concurrency: int = 8
    part_size: int = 16 * 2**20
    keep: frozenset[str] = frozenset()  # cache keys a pod on this node serves: never evicted
    disk_budget: int | None = None  # bytes the cache folder's fetched models may take
    evict: bool = True  # False: never evict (a fetch that cannot know which models are in use)
    hf_cache: Path | None = None  # the Hugging Face cache to resolve from (default: the library's)
    lock_wait_s: float = 600.0  # how long to wait for another fetch into the same DEST
    deadline_s: float = DEFAULT_DEADLINE_S  # the whole fetch, whatever the store does
    min_rate_bps: int = DEFAULT_MIN_RATE_BPS  # a transfer moving less than this over `stall_window_s`
    stall_window_s: float = DEFAULT_STALL_WINDOW_S  # ... stalls: the fetch fails `timeout`
    lease: bool = False  # hold DEST's serving lease for the life of this process (`dlo serve URI`)
    kind: FetchKind = "pipeline"  # what the source must be: a diffusers pipeline, or a folder of LoRA adapters


@dataclass
class FetchResult:
    """What a fetch did (`dlo fetch --result-file`, the fetch Job's termination message)."""

    state: str
    uri: str
    dest: str
    bytes: int = 0
    downloaded_bytes: int = 0
    files: int = 0
    evicted: list[str] = field(default_factory=list)
    already_complete: bool = False
    seconds: float = 0.0
    reason: str = ""
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in ("", None)}


def open_source(uri: ModelURI, options: FetchOptions, guard: Guard | None = None) -> Any:
    if uri.scheme == "s3":
        from dlo.delivery.s3 import S3Source

        return S3Source(uri, options.endpoint, options.concurrency, options.part_size, guard)
    from dlo.delivery.hf import HFSource

    return HFSource(uri, options.endpoint, options.concurrency, options.hf_cache, guard)


def fetch(uri: ModelURI, dest: Path, options: FetchOptions, progress: Progress) -> FetchResult:
    """Fetch `uri` into `dest` (created whole, or left untouched), holding DEST's lock, within
    `options.deadline_s` and the stall bound. Raises FetchError (a disk or file error too; `timeout`
    at the deadline, when the fetch may still be blocked in a read: the process should exit)."""
    guard = Guard(options.deadline_s, options.min_rate_bps, options.stall_window_s, lambda: progress.downloaded)

    def locked() -> FetchResult:
        try:
            with dest_lock(dest, options.lock_wait_s):
                return _fetch(uri, dest, options, progress, guard)
        except OSError as e:
            raise local_error(e, dest) from None

    return guard.run(locked)


def _fetch(uri: ModelURI, dest: Path, options: FetchOptions, progress: Progress, guard: Guard) -> FetchResult:
    started = time.monotonic()
    source = open_source(uri, options, guard)
    for key in options.keep:
        if (folder := path_under(dest.parent, key)).is_dir():
            touch_served(folder)
    if dest.exists():
        result = _already_published(uri, dest, source, started, options)
        if options.lease:
            hold_lease(dest)
        return result
    reclaim_stale_staging(dest.parent)
    files = source.listing()
    staging = Staging(dest, f"{uri}|{options.endpoint or ''}|{source.describe()['revision'] or ''}",
                      [f.path for f in files])
    try:
        if options.kind == "lora":
            check_adapters(str(uri), [f.path for f in files])
        else:
            _refuse_unless_pipeline(uri, source, staging, files, progress)
    except SourceRefused:
        staging.discard()  # nothing worth resuming: the source is not a model
        raise
    total = sum(f.size for f in files)
    keep = set(options.keep) | {dest.name}
    if not options.evict:
        keep |= {m.key for m in cached_models(dest.parent)}
    evicted = make_room(dest.parent, dest, total, total - staging.done_bytes(files), options.disk_budget, keep)
    progress.start(total, len(files), staging.done_bytes(files), sum(staging.verified(f) for f in files))
    source.download(staging, files, progress)
    if options.kind == "pipeline":
        check_pipeline(str(uri), [f.path for f in files], read_json_file(str(staging.root)))
    if options.lease:
        hold_lease(staging.root)  # the lease is on the folder itself: it stays with it when it is renamed
    with guard.commit():
        staging.publish(files, source.describe())
    touch_served(dest)
    progress.close()
    log.info("fetched uri=%s dest=%s bytes=%d downloaded=%d files=%d evicted=%s", uri, dest, total,
             progress.downloaded, len(files), ",".join(evicted) or "none")
    return FetchResult("complete", str(uri), str(dest), total, progress.downloaded, len(files), evicted,
                       seconds=round(time.monotonic() - started, 3))


def _refuse_unless_pipeline(uri: ModelURI, source: Any, staging: Staging, files: list[SourceFile],
                            progress: Progress) -> None:
    """Before the bulk: a listing without model_index.json is refused at once; else the small JSON
    files are fetched and the whole pipeline is checked against the listing."""
    paths = [f.path for f in files]
    if "model_index.json" not in paths:
        check_pipeline(str(uri), paths, lambda p: {})  # refuses, naming what is missing
    source.download(staging, index_files(files), progress)
    check_pipeline(str(uri), paths, read_json_file(str(staging.root)))


def _already_published(uri: ModelURI, dest: Path, source: Any, started: float, options: FetchOptions) -> FetchResult:
    """DEST exists: complete when it is this source's published folder and (for S3) the prefix still
    lists the same objects. Nothing is downloaded."""
    manifest = published_manifest(dest)
    if manifest is None or manifest.get("uri") != str(uri) or manifest.get("endpoint") != options.endpoint:
        raise SourceRefused(f"{dest} exists and is not a folder `dlo fetch` published from {uri}: remove it or "
                            "choose another DEST", reason="invalid")
    if uri.scheme == "s3":
        listed = {f.path: f.to_json() for f in source.listing()}
        if listed != manifest["files"]:
            raise FetchError("source_changed", f"{uri} changed since it was fetched into {dest}: objects under a "
                             "model prefix are treated as immutable; put the new model under a new prefix")
    _check_sizes(dest, manifest["files"])
    touch_served(dest)
    files = manifest["files"]
    return FetchResult("complete", str(uri), str(dest), int(manifest.get("bytes") or 0), 0, len(files),
                       already_complete=True, seconds=round(time.monotonic() - started, 3))


def _check_sizes(dest: Path, files: dict[str, Any]) -> None:
    """Each file of a published folder's manifest is there with its size (a file truncated or removed
    since the fetch is a damaged model, not a complete one)."""
    for name, entry in sorted(files.items()):
        path = path_under(dest, name)
        size = path.stat().st_size if path.is_file() else None
        published = entry.get("size") if isinstance(entry, dict) else None
        if size is None or size != published:
            found = "missing" if size is None else f"{size} bytes"
            raise FetchError("verify", f"{dest} is damaged: {name} is {found} but was published with {published} "
                             f"bytes: remove {dest} and fetch again")


def model_folder(text: str, cache_root: Path, progress: Progress, options: FetchOptions = FetchOptions()) -> Path:
    """A model URI as a pipeline folder for `dlo serve`: a revision already in the Hugging Face
    cache is its snapshot folder (no network, no copy); anything else is fetched into
    `cache_root/<cache key>` (once; later calls find it complete)."""
    uri = parse_uri(text)
    if uri.scheme == "hf":
        from dlo.delivery.hf import HFSource

        snapshot = HFSource(uri, options.endpoint, cache_dir=options.hf_cache).cached_snapshot()
        if snapshot is not None:
            paths = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
            check_pipeline(str(uri), paths, read_json_file(str(snapshot)))
            return snapshot
    dest = cache_path(cache_root, uri, options.endpoint)
    fetch(uri, dest, options, progress)
    return dest


def serving_folder(text: str, environ: Any) -> tuple[Path, str]:
    """`dlo serve URI`: the folder to serve (fetched into `default_cache_root` unless a cached Hugging
    Face snapshot is there) and the model's name (the served model id). Raises FetchError."""
    uri = parse_uri(text)
    # the SDKs' own endpoint variables: named here too, so another store is another cache folder
    names = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") if uri.scheme == "s3" else ("HF_ENDPOINT",)
    endpoint = next((environ[n] for n in names if environ.get(n)), None)
    options = FetchOptions(endpoint=endpoint, lease=True)  # held while this process serves it: never evicted
    progress = Progress("auto", stream=log_lines(PROGRESS_LOGGER))  # type: ignore[arg-type]  # records under JSON
    folder = model_folder(text, default_cache_root(environ), progress, options)
    return folder, uri.name


def default_cache_root(environ: Any) -> Path:
    """Where `dlo serve URI` keeps fetched models: $XDG_CACHE_HOME/dlo/models (~/.cache/dlo/models)."""
    base = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME") or "~").expanduser() / ".cache")
    return Path(base) / "dlo" / "models"
