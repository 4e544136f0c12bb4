"""The environment every multi-GPU benchmark process runs under: NVLink multicast off.

Owns: `MULTICAST_OFF` (the variables and values) and `multicast_off()`, which sets them in this
process before torch or NCCL is imported, so that it and the rank processes it spawns inherit them.
Must never: read or set anything else (engine switches are `dlo.engine.settings.from_environment`'s).

Why: the lent H200 hosts must keep NVLink SHARP / multicast (NVLS) off (the device guide's rule for
NCCL, torch's symmetric memory and NVSHMEM alike); a benchmark that forgot one of the three would
measure another transport and could trip the machine's settings.
"""

from __future__ import annotations

import os
from typing import MutableMapping

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def multicast_off(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set the three variables (overriding any other value); returns what was set."""
    environ.update(MULTICAST_OFF)
    return dict(MULTICAST_OFF)
