"""Errors of a fetch, each with a stable `reason` (the fetch Job's result and the operator's status
use it) and the exit code `dlo fetch` answers with.

Owns: `FetchError` and `SourceRefused`, and the list of reasons.
Must never: import anything but the standard library.
"""

from __future__ import annotations

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
