"""The environment of every process a `dlo serve` process starts: the ranks and the start's helpers.

Owns: `API_KEY_ENV` and `child_env` (this process's environment without the API key: rank 0 alone
answers HTTP, so no child sees the key, not even in its environment).
Must never: import anything beyond the standard library (the readahead's child imports it).
"""

from __future__ import annotations

import os

API_KEY_ENV = "DLO_API_KEY"


def child_env() -> dict[str, str]:
    """This process's environment without the API key."""
    return {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
