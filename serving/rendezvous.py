"""How the ranks of one `dlo serve` find each other for the weight plane: on loopback only.

Owns: `join_weight_plane` - rank 0 binds the rendezvous store (torch.distributed's TCPStore) to
127.0.0.1 itself and hands torch the listening socket (torch's own would listen on every
interface), and on gloo every rank's transport device is bound to 127.0.0.1 too. All ranks of a
group share one host (a node group never crosses nodes), so nothing of the weight plane is ever
reachable from the network.
Must never: listen on an address other than loopback, or be used for a group that spans hosts.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

LOOPBACK = "127.0.0.1"
STORE_BACKLOG = 128


def join_weight_plane(backend: str, port: int, rank: int, world: int, timeout: timedelta) -> None:
    """`torch.distributed.init_process_group` over a loopback store (and loopback gloo devices)."""
    import torch.distributed as dist

    fd = None
    if rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((LOOPBACK, port))
        listener.listen(STORE_BACKLOG)
        fd = listener.detach()  # the store owns it from here
    store = dist.TCPStore(LOOPBACK, port, world, is_master=rank == 0, timeout=timeout, master_listen_fd=fd)
    options: Any = None
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        options._timeout = timeout
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, pg_options=options)
