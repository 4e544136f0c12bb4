"""The readahead of a cold checkpoint in a process of its own (`python -m dlo.serving.readahead`).

Why a process: the reads run on `dlo.pagecache.warm`'s thread pool, whose threads take the GIL back
after every chunk. Beside a rank's imports and model builds (GIL-bound Python), eight of them
starved the main thread: on the H200 a cold Wan2.1 start spent 23-25 s in imports that take 2.3 s
warm, while the disk read the folder in 20 s (record `ready-h200-2026-12-01`).
A child shares no GIL, and the pages it reads are the same page-cache pages the rank maps.

[Note: the start's other files first]
Why the start's other files first: a cold node has its Python libraries out of the page cache too,
and a read of the weights keeps the disk's queue full. On the H200 a cold start's imports took
28-30 s against 2.8 s warm, with the readahead in this child (`ready-h200-2026-12-01-c`): every
small read of a `.pyc` or `.so` waited behind the weights' readahead. So the child reads, before the
weights, what the start reads besides them: the Python files and shared libraries of the packages
a rank imports (`--package`) and the pipeline folder's small files, configs and tokenizers
(`--folder`); and it does not advise the kernel to read whole files ahead (its threads' reads keep
the disk busy; the advice queued the whole folder in front of every other read).
That order alone did not help (`ready-h200-2026-12-02-d`: cold imports 29.5-32 s again): the
rank's early registration pins the weights from its first second, and pinning reads them, so the
package reads still queued behind 40 GB. Now the child reads those files before any weights file,
and the rank's registration pins each weights file only once the child has read it ([Note: pin what is read] in `dlo.engine.weights`); and those files are read as the weights are, in chunks on every
thread (one thread per large `.so` read 4 GB of packages at 229 MB/s). Which packages: the
requirement closure of the distributions a rank imports (`--distribution`: each one's installed
files, from its RECORD, its requirements' with their markers evaluated), and `--package` folders
for namespaces no distribution owns alone (`nvidia`).
What those left out (`ready-h200-2026-12-02-e`: the registration waited for them, yet cold imports
took 24-29 s, ending with the weights' read): a trace of a start's imports opened ~570 files outside
them, every one a small read behind the weights', and listed ~1,500 folders. They were the standard
library's bytecode, every installed distribution's metadata (the version checks of diffusers' and
transformers' imports, and the distribution map's child, read it), the project's own modules and
the folders themselves. `--python` reads the first two (`interpreter_files`, `metadata_files`),
`START_FOLDERS` names the project's packages, and `read_first` lists the folder of every file it reads.

Owns: `read_in_child` (the parent's side: run the child, wait, parse its last line; its warnings go to the rank's log), `startup_files` and `distribution_files` (what is read
first), `read_uncached` (`first_cached.py`: [Note: first files already cached]) and `main` (the child: arm the
parent-death signal first, exit if the parent is already gone, read the start's other files (or
find them cached), then warm the weights in the order given, print what it read).
Must never: outlive the process that started it (parent-death signal), write to a model file, or
import torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Iterable, Iterator

from dlo.serving.child_env import child_env, die_with_parent
from dlo.serving.first_cached import is_code, needs_read, residency, sample_facts

THREADS = 8  # requests in flight: enough for an NVMe disk, 8 x 16 MiB of buffers at most
FIRST_THREADS = 16  # for the start's other files: thousands of small ones, each read waits for the disk

log = logging.getLogger(__name__)


class ReadaheadError(RuntimeError):
    """The readahead's child failed (its last line of stderr says why)."""


WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf")  # a folder's files read after the rest
# a model folder's other files read first are its configs and tokenizers (the largest: Qwen-Image's
# and UMT5's tokenizer.json, 11-16 MB); anything larger is not what a start reads before the weights
FOLDER_FILE_BYTES = 64 << 20


def read_in_child(files: list[Path], threads: int = THREADS, packages: tuple[Path, ...] = (),
                  folders: tuple[Path, ...] = (), distributions: tuple[str, ...] = (),
                  python: bool = False) -> dict[str, Any]:
    """Warm `files` (in this order) in a child process, the `startup_files` of `packages`,
    `folders`, `distributions` and (`python`) the interpreter's first; what it read: files, bytes,
    seconds, pid, and `first` (files, bytes, seconds, and the sample its verdict was drawn from)."""
    argv = [sys.executable, "-m", __name__, "--threads", str(threads), "--parent-pid", str(os.getpid()),
            "--sys-path", json.dumps(sys.path), *(["--python"] if python else []),
            *(a for p in packages for a in ("--package", str(p))), *(a for f in folders for a in ("--folder", str(f))),
            *(a for d in distributions for a in ("--distribution", d)), *map(str, files)]
    with tempfile.TemporaryFile("w+", errors="replace") as err:  # a file, not a pipe: warnings never block the child
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=child_env()) as proc:
            lines = list(_lines(proc.stdout))
        err.seek(0)
        stderr = err.read().strip()
    if proc.returncode != 0 or not lines:
        why = (stderr.splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise ReadaheadError(f"the readahead process failed: {why}")
    if stderr:  # warnings of a read that still finished: the rank's log keeps them
        log.warning("the readahead process said: %s", stderr[-2000:])
    return json.loads(lines[-1])


def _lines(stdout: IO[str] | None) -> Iterator[str]:
    """The child's non-empty lines as they come."""
    for line in stdout or ():
        if line.strip():
            yield line


def startup_files(packages: tuple[Path, ...], folders: tuple[Path, ...],
                  distributions: tuple[str, ...] = (), path: list[str] | None = None,
                  python: bool = False) -> list[Path]:
    """What a start reads besides the weights, in this order: with `python`, the metadata of every
    distribution on `path` (default `sys.path`) and the standard library's modules; the Python files
    and shared libraries (`.py`, `.pyc`, `.so`, `.so.N`) of `distributions` with their requirements
    (found on `path`), then of each package folder, then each folder's small files that are not
    weights (`_small_config`); each once."""
    from dlo.pagecache.tree import FolderTooDeep, walk_files

    out = [*metadata_files(path), *interpreter_files()] if python else []
    out.extend(f for f in distribution_files(distributions, path) if is_code(f.name))
    for roots, keep in ((packages, lambda f, root: is_code(f.name) and f.is_file()), (folders, _small_config)):
        for root in roots:
            try:
                out.extend(f for f in walk_files(root) if keep(f, root))
            except (FolderTooDeep, OSError) as e:  # what was found before stays; the start goes on
                log.warning("the readahead skips the rest of %s: %s", root, e)
    return list(dict.fromkeys(out))


def _small_config(f: Path, root: Path) -> bool:
    """A model folder's file that a start reads besides the weights: not a weight, not under a
    hidden folder (`.git`'s LFS objects, `.cache`'s partial downloads), at most `FOLDER_FILE_BYTES`."""
    if f.name.endswith(WEIGHTS) or any(part.startswith(".") for part in f.relative_to(root).parts[:-1]):
        return False
    try:
        return f.is_file() and f.stat().st_size <= FOLDER_FILE_BYTES
    except OSError:
        return False


def distribution_files(names: tuple[str, ...], path: list[str] | None = None) -> list[Path]:
    """The installed files (their RECORD, with each `.py`'s cached bytecode; existing ones, each
    once) of the distributions `names` and of every distribution they require, transitively
    (markers evaluated here, extras left out; one not installed is skipped); `path`: where to look
    (default `sys.path`)."""
    from importlib.metadata import Distribution

    seen: set[str] = set()
    out: list[Path] = []
    todo = list(names)
    while todo:
        name = _canonical(todo.pop(0))
        if name in seen:
            continue
        seen.add(name)
        dist = next(iter(Distribution.discover(name=name, path=path if path is not None else sys.path)), None)
        if dist is None:
            continue
        out.extend(p for p in _with_bytecode(Path(str(dist.locate_file(f))) for f in dist.files or ()) if p.is_file())
        todo.extend(_required(dist.requires or ()))
    return list(dict.fromkeys(out))


# the standard library's folders no start imports from (its test suite, GUI, installers) and the
# distributions' folders some layouts nest in it (`distribution_files` reads what a start needs there)
STDLIB_SKIPPED = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "tkinter",
                            "turtledemo", "ensurepip", "lib2to3", "__pycache__"})
METADATA_FOLDERS = (".dist-info", ".egg-info")


def interpreter_files() -> list[Path]:
    """The standard library's modules as an import reads them: each `.py`'s cached bytecode (the
    `.py` where none is cached) and each extension module, `STDLIB_SKIPPED` folders left out."""
    import sysconfig
    from importlib.util import cache_from_source

    out: list[Path] = []
    for root in dict.fromkeys(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")):
        for folder, subfolders, names in os.walk(root):
            subfolders[:] = sorted(d for d in subfolders if d not in STDLIB_SKIPPED)
            for name in sorted(names):
                f = Path(folder, name)
                if name.endswith(".py"):
                    cached = Path(cache_from_source(str(f)))
                    out.append(cached if cached.is_file() else f)
                elif is_code(name):
                    out.append(f)
    return out


def metadata_files(path: list[str] | None = None) -> list[Path]:
    """The files of every distribution's metadata folder (`.dist-info`, `.egg-info`) and the `.pth`
    files in the folders of `path` (default `sys.path`): what `importlib.metadata` reads."""
    out: list[Path] = []
    for entry in dict.fromkeys(path if path is not None else sys.path):
        try:
            with os.scandir(entry or ".") as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:  # a zip, a folder gone or unreadable: nothing of it to read ahead
            continue
        for e in entries:
            if e.name.endswith(METADATA_FOLDERS) and e.is_dir():
                try:
                    with os.scandir(e.path) as files:
                        out.extend(sorted(Path(f.path) for f in files if f.is_file()))
                except OSError:  # unreadable, or gone since the listing: the start reads it itself
                    continue
            elif e.name.endswith(".pth") and e.is_file():
                out.append(Path(e.path))
    return out


def _with_bytecode(files: Iterable[Path]) -> Iterator[Path]:
    """`files`, each `.py` followed by its cached bytecode (which a RECORD lists only when the
    installer compiled it: not after `pip install --no-compile` and a later `compileall`)."""
    from importlib.util import cache_from_source

    for f in files:
        yield f
        if f.suffix == ".py" and "__pycache__" not in f.parts:
            yield Path(cache_from_source(str(f)))


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _required(requires: Iterable[str]) -> list[str]:
    """The names of `requires` (Requires-Dist lines) that apply here, no extra asked for."""
    from packaging.requirements import InvalidRequirement, Requirement

    out = []
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(req.name)
    return out


def read_first(files: list[Path], threads: int) -> dict[str, Any]:
    """Read `files` whole, `threads` reads at a time, a large file in chunks spread over the threads
    as the weights are (most files are small: one read each); files, bytes, seconds."""
    from concurrent.futures import ThreadPoolExecutor

    from dlo.pagecache.warm import READ_BYTES, read_range

    t0 = time.monotonic()
    unread: list[str] = []

    def read(job: tuple[Path, int, int]) -> int:
        try:
            return read_range(*job)
        except OSError as e:  # best effort: the start reads this file itself, the weights still come next
            unread.append(f"{job[0]}: {e}")
            return 0

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dlo-first") as pool:
        list(pool.map(_list, dict.fromkeys(f.parent for f in files)))  # an import lists each folder it searches
        sizes = list(zip(files, pool.map(_size, files)))  # thousands of stats: in flight together too
        done = sum(pool.map(read, [(f, off, min(READ_BYTES, n - off)) for f, n in sizes for off in range(0, n, READ_BYTES)]))
    if unread:
        print(f"the readahead could not read {len(unread)} of its first files (the start reads them itself), "
              f"e.g. {unread[0]}", file=sys.stderr)
    return {"files": len(files), "bytes": done, "seconds": round(time.monotonic() - t0, 2)}


def _list(folder: Path) -> None:
    try:
        with os.scandir(folder) as it:
            for _ in it:
                pass
    except OSError:  # gone or unreadable: the start lists it itself
        pass


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # gone (or unreadable) since it was listed: nothing to read
        return 0


def main(argv: list[str] | None = None) -> int:
    die_with_parent()  # first: a parent gone from here on kills this process
    ap = argparse.ArgumentParser(prog="python -m dlo.serving.readahead",
                                 description="Read FILES into the page cache, in order (a rank's cold start).")
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--parent-pid", type=int, default=None, help="exit at once if this is no longer the parent")
    ap.add_argument("--package", type=Path, action="append", default=[],
                    help="a package folder whose Python files and shared libraries are read first")
    ap.add_argument("--folder", type=Path, action="append", default=[],
                    help="a folder whose files other than weights are read first (after the packages')")
    ap.add_argument("--distribution", action="append", default=[],
                    help="an installed distribution whose files (and its requirements', transitively) are read first")
    ap.add_argument("--python", action="store_true",
                    help="read first the standard library's modules and every distribution's metadata on --sys-path")
    ap.add_argument("--first-threads", type=int, default=FIRST_THREADS, help="reads in flight for those files")
    ap.add_argument("--sys-path", type=json.loads, default=None,
                    help="where to find the distributions: the parent's sys.path, as JSON (default: this one's)")
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    if args.parent_pid is not None and os.getppid() != args.parent_pid:
        return 1  # the parent went before the death signal was armed: nobody waits for this read
    import threading

    from dlo.pagecache.warm import warm

    t0 = time.monotonic()
    files = startup_files(tuple(args.package), tuple(args.folder), tuple(args.distribution), args.sys_path,
                          python=args.python)
    behind: dict[str, Any] = {}
    thread = None
    sample = sample_facts(files)
    if sample["cached"]:  # [Note: first files already cached]: said at once, read beside the weights
        first = {"files": len(files), "bytes": 0, "seconds": round(time.monotonic() - t0, 2), "cached": True}
        thread = threading.Thread(target=lambda: behind.update(read_uncached(files, args.first_threads)),
                                  name="dlo-first", daemon=True)
    else:
        first = read_first(files, args.first_threads)
    first["sample"] = {k: v for k, v in sample.items() if k != "cached"}  # what the verdict was drawn from
    if thread is not None:
        thread.start()
    session = warm(args.files, threads=args.threads, advise=False)
    if thread is not None:
        thread.join()
        first["behind"] = behind  # what the sample missed, read beside the weights
    print(json.dumps({"files": len(args.files), "bytes": session.after.bytes, "seconds": round(session.seconds, 2),
                      "pid": os.getpid(), "first": first}))
    return 0


def read_uncached(files: list[Path], threads: int) -> dict[str, Any]:
    """`read_first` of those of `files` that `needs_read` (the files other than code not whole)."""
    rest = [f for f in files if not is_code(f.name)]  # code is never read here: no residency check for it
    return read_first([f for f, c in zip(rest, residency(rest)) if needs_read(f, c)], threads)


if __name__ == "__main__":
    raise SystemExit(main())
