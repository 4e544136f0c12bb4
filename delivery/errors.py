"""Errors of a fetch, each with a stable `reason` (the fetch Job's result and the operator's status
use it) and the exit code `dlo fetch` answers with.

Owns: `FetchError` and `SourceRefused`, the list of reasons, and `local_error` (a disk or file
error as a FetchError).
Must never: import anything but the standard library.
"""

from __future__ import annotations

import errno
from pathlib import Path

# reason -> what it means (docs/operator.md, "Model delivery")
REASONS = {
    "refused": "the source is not a complete diffusers pipeline (nothing was published)",
    "invalid": "the URI, revision or destination is not usable",
    "auth": "the store refused the credentials",
    "not_found": "the bucket, prefix, repository or revision does not exist",
    "disk_full": "the disk cannot hold the model",
    "disk_budget": "the cache's disk budget cannot hold the model without evicting one in use",
    "verify": "a downloaded file does not match its size or checksum",
    "source_changed": "the source changed while or since it was fetched",
    "transfer": "the store or the network failed",
    "timeout": "the fetch ran past --deadline, or a transfer moved less than --min-rate over --stall-window",
}


class FetchError(RuntimeError):
    """A fetch that cannot complete; the message says what, where and what to do."""

    exit_code = 1

    def __init__(self, reason: str, message: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown fetch failure reason {reason!r}")
        super().__init__(message)
        self.reason = reason


class SourceRefused(FetchError):
    """Bad input: not a diffusers pipeline, or a URI that cannot be fetched (exit 2)."""

    exit_code = 2

    def __init__(self, message: str, reason: str = "refused") -> None:
        super().__init__(reason, message)


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def local_error(e: OSError, dest: Path) -> FetchError:
    """A disk or file error of a fetch into `dest` (no space, a quota, permissions, a read-only or
    failing file system) as a one-line FetchError: `disk_full` when space ran out, else `invalid`."""
    where = f"{e.filename}: " if e.filename else ""
    what = e.strerror or str(e) or type(e).__name__
    if e.errno in _FULL:
        return FetchError("disk_full", f"{where}{what} while fetching into {dest}: free space (or raise the "
                          "quota) and run again; the fetch resumes")
    return FetchError("invalid", f"{where}{what} while fetching into {dest}: check the permissions and the file "
                      f"system under {dest.parent}")
