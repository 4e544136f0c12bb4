"""A free local TCP port (the rendezvous of the weight plane, the control plane, test servers).

Owns: `free_port`. Must never: import torch (the server launcher and benchmarks use it torch-free).
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
