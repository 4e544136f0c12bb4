"""What a rank's start can do beside its GIL-bound imports: read a cold checkpoint ahead, and load
and initialise the device libraries every request uses.

Owns: `start_beside_imports` and `join_logged` (both jobs, as `ServingPipeline` runs them),
`start_early_readahead` (the readahead from `dlo serve`'s first steps, adopted by rank 0's load),
`start_early_library_warmup` (rank 0's library warm-up from `dlo serve`'s checks, once torch is
imported, adopted by its load: it took 1.4-2.8 s on the H200 and the load had waited up to 0.95 s
for it; `end_early_library_warmups` waits for it when the start is refused),
`start_readahead` (the pipeline folder's safetensors files that are not in the page cache,
read in the order the load needs them, in parallel chunks at the disk's speed by `dlo.pagecache.warm`
in a child process, `readahead.py`, waited for on a thread, after the files of `START_DISTRIBUTIONS`
(with their requirements), `START_FOLDERS` and the folder's small files, which the child reads
first; a warm page cache costs one residency check per file) and `start_library_warmup`
(on a side stream of the device: bf16 and fp32 GEMMs, fused attention, 2-D and 3-D convolutions,
norms, so that cuBLAS(Lt), cuDNN and the attention kernels are loaded and initialised here,
inside C++ that releases the GIL, while the main thread imports; not in the warm-up generation
before `/ready`). Both return a handle whose `join()` says what it did.
Must never: change what a request computes (the library warm-up runs on tensors of its own, uses
no random numbers, and leaves kernel selection as it was: cuDNN benchmarking stays off, so its
heuristics choose the same algorithms whenever they are first asked), fail a start (each logs a
warning and stops), or write to a model file.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger(__name__)

RESIDENT_ENOUGH = 0.999  # a file this much in the page cache is not read again


class Background:
    """One daemon thread running `work`; `join()` returns its result (None after a failure, logged)."""

    def __init__(self, name: str, work: Callable[[], Any]):
        self.name = name
        self.result: Any = None
        self.seconds = 0.0
        self.started = time.monotonic()

        def run() -> None:
            t0 = time.perf_counter()
            try:
                self.result = work()
            except Exception as e:  # a start goes on without it: the warm-up or the load pays instead
                log.warning("%s failed (the start goes on without it): %s: %s", name, type(e).__name__, e)
            self.seconds = time.perf_counter() - t0

        self._thread = threading.Thread(target=run, name=f"dlo-{name}", daemon=True)
        self._thread.start()

    def join(self) -> Any:
        self._thread.join()
        return self.result


def start_beside_imports(model_dir: Path, components: tuple[str, ...], device: Any) -> tuple[Any, Any]:
    """The readahead of `model_dir` (`components` first; the one `start_early_readahead` started in
    this process, if any) and the library warm-up of `device`, each on a thread while the caller
    imports and builds; `join_logged` each (None: nothing started)."""
    key = Path(model_dir).resolve()
    if key in _EARLY:
        readahead, problem = _EARLY.pop(key)
        if readahead is not None:
            log.info("readahead of %s adopted (started with dlo serve's checks, %.1f s before this load)",
                     readahead.what, time.monotonic() - readahead.started)
    else:
        readahead, problem = _readahead_or_problem(model_dir, components)
        if readahead is not None:
            log.info("readahead of %s started", readahead.what)
    if problem:
        log.warning("no readahead (the start goes on without it): %s", problem)
    return readahead, _library_warmup(device)


# rank 0's library warm-up `dlo serve` started with its checks, by device, until the load takes it
_EARLY_LIBRARIES: dict[str, Background | None] = {}


def start_early_library_warmup(device: Any) -> None:
    """`start_library_warmup(device)` now, from `dlo serve`'s checks once torch is imported: the
    load of this process's rank on `device` adopts it (`start_beside_imports`)."""
    import torch

    device = torch.device(device)
    _EARLY_LIBRARIES[str(device)] = start_library_warmup(device)


def end_early_library_warmups() -> None:
    """A start refused after its early library warm-up began: wait for it (seconds at most), so the
    process never exits while a thread is inside the device's libraries."""
    while _EARLY_LIBRARIES:
        _, job = _EARLY_LIBRARIES.popitem()
        if job is not None:
            job.join()


def _library_warmup(device: Any) -> Background | None:
    """The library warm-up `dlo serve` started for `device`, else one started now."""
    key = str(device)
    if key not in _EARLY_LIBRARIES:
        return start_library_warmup(device)
    job = _EARLY_LIBRARIES.pop(key)
    if job is not None:
        log.info("library warm-up adopted (started with dlo serve's checks, %.1f s before this load)",
                 time.monotonic() - job.started)
    return job


# the readahead `dlo serve` started before its own imports (or why it could not), by folder, until
# the load takes it; nothing is logged before then (a start refused later says one line only)
_EARLY: dict[Path, tuple[Readahead | None, str]] = {}


def start_early_readahead(model_dir: Path, components: tuple[str, ...]) -> None:
    """`start_readahead` now, at the start of `dlo serve`, before torch is imported: a cold start's
    reads begin seconds earlier, the server's own imports among them; this process's load adopts it
    (`start_beside_imports`)."""
    _EARLY[Path(model_dir).resolve()] = _readahead_or_problem(model_dir, components)


def _readahead_or_problem(model_dir: Path, components: tuple[str, ...]) -> tuple[Readahead | None, str]:
    """`start_readahead`, or None and why when even its residency check fails (a mount whose files
    cannot be measured or mapped): the start goes on and reads as it loads."""
    try:
        return start_readahead(model_dir, components), ""
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


def join_logged(job: Background | None) -> None:
    """Wait for `job` (if one started) and log what it did."""
    if job is not None:
        result = job.join()
        log.info("%s done seconds=%.2f result=%s (beside the imports)", job.name, job.seconds, result)


PIN_POLL_S = 0.05  # how often a registration waiting for a file asks the page cache about it
PIN_WAIT_S = 120.0  # the longest it waits for one file (a readahead that stopped reading)


class Readahead(Background):
    """The readahead's job (the child reads the start's other files, then the weights): on a cold
    start the rank's early registration pins each weights file once `until_resident` says the child
    has read it (`dlo.engine.weights.ReadFront`, [Note: pin what is read] there)."""

    def __init__(self, read: Callable[[], Any], what: str):
        self.what = what  # "N files not in the page cache (B bytes)"
        super().__init__("readahead", read)

    def until_resident(self, path: Path, stop: threading.Event) -> float:
        """Wait until `path` is `RESIDENT_ENOUGH` in the page cache, the readahead has ended (a file
        it did not read, or one evicted since, is read by whoever maps it), `stop` is set, or
        `PIN_WAIT_S` passed; the seconds waited."""
        from dlo.pagecache.residency import file_residency

        t0 = time.perf_counter()
        while self._thread.is_alive() and not stop.is_set() and time.perf_counter() - t0 < PIN_WAIT_S:
            try:
                if file_residency(path).ratio >= RESIDENT_ENOUGH:
                    break
            except OSError:  # cannot be measured: the registration reads it as before
                break
            stop.wait(PIN_POLL_S)
        return time.perf_counter() - t0


def start_readahead(model_dir: Path, components: tuple[str, ...],
                    distributions: tuple[str, ...] | None = None) -> Readahead | None:
    """Read the files of `model_dir` that are not in the page cache, those of `components` first
    (in that order), the rest of the folder's safetensors after, the files a start reads besides
    them before (of `distributions`; by default `START_DISTRIBUTIONS` with `START_FOLDERS`, the
    standard library's modules and every distribution's metadata: `readahead.startup_files`);
    None when every weight is cached."""
    from dlo.pagecache.residency import file_residency, model_files

    ordered: list[Path] = []
    for sub in (*components, ""):
        folder = model_dir / sub if sub else model_dir
        ordered.extend(f for f in (model_files(folder) if folder.exists() else []) if f not in ordered)
    cold = [f for f in ordered if file_residency(f).ratio < RESIDENT_ENOUGH]
    if not cold:
        return None
    default = distributions is None  # a start's: its libraries, the interpreter's and the project's own
    names, packages = (START_DISTRIBUTIONS, package_folders(START_FOLDERS)) if default else (distributions, ())

    from dlo.serving.readahead import read_in_child

    def read() -> dict[str, Any]:
        # a process of its own: its reads never take this one's GIL; the imports' and the
        # tokenizers' files first ([Note: the start's other files first] in readahead.py)
        return read_in_child(cold, packages=packages, folders=(model_dir,), distributions=names, python=default)

    return Readahead(read, f"{len(cold)} files not in the page cache ({sum(f.stat().st_size for f in cold)} bytes)")


# the distributions a rank imports or loads libraries from once the readahead has started, read
# with their requirements before the weights (torch's own imports are done by then; its lazily
# loaded libraries, cuDNN and cuBLAS among them, sit in torch/lib and the nvidia packages)
START_DISTRIBUTIONS = ("diffusers", "transformers", "tokenizers", "safetensors", "torch", "imageio", "ftfy",
                       "psutil", "nvidia-ml-py", "sniffio")
# `nvidia`: a namespace of many distributions, whichever torch build requires; the project's own
# packages a rank imports (in a source checkout no installed RECORD lists them)
START_FOLDERS = ("nvidia", "dlo.engine", "dlo.serving", "dlo.plan", "dlo.pagecache")


def package_folders(names: tuple[str, ...]) -> tuple[Path, ...]:
    """The folders of the installed packages `names` (none imported: a dotted name's parents are, as
    `importlib.util.find_spec` does; a missing one skipped)."""
    import importlib.util

    out: list[Path] = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:  # a package, not a lone module
            out.extend(Path(p) for p in spec.submodule_search_locations)
    return tuple(dict.fromkeys(out))


def start_library_warmup(device: Any) -> Background | None:
    """Load and initialise the device libraries on a side stream of `device` (cuda only)."""
    if getattr(device, "type", "") != "cuda":
        return None
    return Background("library-warmup", lambda: warm_libraries(device))


def warm_libraries(device: Any) -> float:
    """The first call of each library a diffusion pipeline uses, at small shapes, on a stream of its
    own (cuda), waited for; returns the seconds it took. Runs on any device (the shapes are checked
    on cpu)."""
    import contextlib

    import torch
    import torch.nn.functional as F

    t0 = time.perf_counter()
    device = torch.device(device)
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None
    on_side = (contextlib.ExitStack() if stream is None else torch.cuda.stream(stream))
    with on_side, torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float32):
            a = torch.ones(256, 256, dtype=dtype, device=device)
            F.linear(a, a, a[0])  # cuBLASLt (with bias) and cuBLAS
            torch.bmm(a[None], a[None])
            F.layer_norm(a, (256,))
            F.softmax(a, dim=-1)
        q = torch.ones(1, 8, 256, 128, dtype=torch.bfloat16, device=device)
        F.scaled_dot_product_attention(q, q, q)  # the fused attention kernels
        x = torch.ones(1, 8, 16, 16, device=device)
        F.group_norm(F.conv2d(x, torch.ones(8, 8, 3, 3, device=device), padding=1), 4)  # cuDNN
        F.conv3d(x[:, :, None], torch.ones(8, 8, 3, 3, 3, device=device), padding=1)
        F.interpolate(x, scale_factor=2.0, mode="nearest")
    if stream is not None:
        stream.synchronize()
    return time.perf_counter() - t0
