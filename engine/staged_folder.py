"""A pipeline folder written beside another (`dlo quantize`, `dlo fuse-lora`): staged in a marked
`DST.partial`, the untouched files hard-linked, published by one rename.

Owns: `FolderError` (a refusal: one line naming the folder), `staging_folder`, `check_paths` (SRC
and DST, or `DST.partial`, inside one another refused), `check_free`, `claim` (`DST.partial` made
this run's with the marker of `dlo.delivery.owned`: one a live run is writing refused, one without
the marker refused; a killed run's removed, or taken over where the caller resumes and the marker's
facts are this run's), `publish` (synced, renamed to DST, the marker dropped), `link_rest` and
`link_or_copy` (hard links, copies across filesystems), `progress_bar`.
Must never: write into or delete SRC, delete a folder it did not make, or import torch.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from dlo.delivery.owned import MARKER, NotMarked, make_marked, maker_alive, marker_of, remove_marked, take_over


class FolderError(ValueError):
    """Input a folder writer refuses: the message names the argument and what to do."""


def staging_folder(dst: Path) -> Path:
    """Where DST is written before its rename: `DST.partial` beside it."""
    return dst.with_name(dst.name + ".partial")


def check_paths(src: Path, dst: Path, label: str = "SRC") -> None:
    """Refuse SRC and DST (both resolved) that overlap: SRC equal to or inside DST or `DST.partial`
    (the staging folder may be removed: SRC with it), or DST inside SRC (SRC written into). `label`:
    what the message calls SRC (the command's name for that argument)."""
    partial = staging_folder(dst)
    linked = Path(os.path.realpath(partial))  # where a link named DST.partial leads
    for other, what in ((dst, "DST"), (partial, "DST's staging folder"), (linked, "DST's staging folder")):
        if src == other or other in src.parents:
            raise FolderError(f"{label} {src} is or lies inside {what} {other}; choose a DST outside {label}")
    if src in dst.parents:
        raise FolderError(f"DST {dst} lies inside {label} {src}; choose a folder outside it")


def check_free(dst: Path, need: int, what: str) -> None:
    """Refuse a DST whose filesystem has less than `need` bytes free (`what` needs them)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dst.parent).free
    if need > free:
        raise FolderError(f"DST {dst}: {what} need {need / 2**30:.2f} GiB and {free / 2**30:.2f} GiB are free on "
                          "its filesystem")


def claim(partial: Path, maker: str, *, resume: bool = False, **facts: Any) -> bool:
    """Make `partial` this run's; True where a killed run's is taken over to be resumed (`resume`
    and its marker holds these `facts`: the same inputs), False where it is made anew (a killed
    run's removed first). One a live run of `maker` is writing, or that `maker` did not make, is
    refused (`FolderError`)."""
    found = marker_of(partial)
    if found is not None and found["made_by"] == maker and maker_alive(found):
        raise FolderError(f"{partial} is being written by another {maker} (pid {found.get('pid')}); wait for it "
                          "to end or choose another DST")
    if resume and found is not None and found["made_by"] == maker and all(found.get(k) == v for k, v in facts.items()):
        take_over(partial, found)
        return True
    try:
        remove_marked(partial, maker)
    except NotMarked as e:
        raise FolderError(str(e)) from None
    make_marked(partial, maker, **facts)
    return False


def publish(partial: Path, dst: Path) -> None:
    """The complete `partial` on disk and renamed to DST (an empty DST is replaced), unmarked."""
    os.sync()
    partial.rename(dst)
    (dst / MARKER).unlink(missing_ok=True)


def link_rest(src: Path, dst: Path, done: set[str]) -> int:
    """Every other file of SRC at the same place in DST: hard links (no bytes) or copies. `done`:
    relative paths (folders or files) already written, left out."""
    n = 0
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src)
        if path.is_dir() or rel.as_posix() == MARKER or any(rel.as_posix() == d or d in map(str, rel.parents)
                                                            for d in done):
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        link_or_copy(path, dst / rel)
        n += 1
    return n


def link_or_copy(src: Path, dst: Path) -> None:
    """`dst` the same file as `src`: a hard link, else (another filesystem, links refused) a copy.
    A `dst` already there (a resumed run's) is replaced."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def progress_bar(total: int, show: bool, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not show)
