"""Third-party noise on a normal `dlo serve` start, filtered where it is not ours to fix.

Every rank's start printed, through no fault of the user's: diffusers' advice to `pip install
accelerate` (DLO loads the transformers itself; the other components are small), and a "Loading
pipeline components" progress bar into a log. (Its FutureWarning that `torch_dtype` is deprecated
was ours to fix: the family adapters pass `dtype`.)
Owns: `quiet_libraries`, called first by `dlo serve` (rank 0) and by each other rank's main: the
message filtered by its text, and progress bars (tqdm's) only when stderr is a terminal
(`TQDM_DISABLE`, which tqdm reads when it is imported and the ranks inherit).
Must never: hide a warning or log line of ours, or a library's beyond the messages named here, or
override a `TQDM_DISABLE` the user set.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import IO

ACCELERATE_HINT = "`accelerate` was not found"  # diffusers' from_pretrained, a logger warning
# the diffusers loggers that give the hint (pipelines and models), named before diffusers is imported
HINT_LOGGERS = ("diffusers.pipelines.pipeline_utils", "diffusers.models.modeling_utils")


class _DropAccelerateHint(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return ACCELERATE_HINT not in record.getMessage()


_DROP = _DropAccelerateHint()


def quiet_libraries(stream: IO[str] | None = None) -> None:
    """Filter the libraries' messages named above in this process; progress bars off unless
    `stream` (stderr) is a terminal. Call it before tqdm is imported (the start of a rank's main)."""
    for name in HINT_LOGGERS:
        logging.getLogger(name).addFilter(_DROP)  # once: a logger keeps one copy of a filter
    stream = stream if stream is not None else sys.stderr
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):  # closed or no real stream
        terminal = False
    if not terminal:
        os.environ.setdefault("TQDM_DISABLE", "1")
