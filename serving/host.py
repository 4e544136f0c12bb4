"""This host as the plan sees it: a `NodeProfile` from the engine's own device facts.

Owns: `local_profile(device)` (devices, memory, interconnect from `dlo.engine.devices`; the nominal
bandwidths of `dlo.plan.profile`; with no accelerator the policy budgets "device" weights in host RAM).
Must never: measure anything (`dlo calibrate` does) or choose a mode (`dlo.plan.deployment.plan` does).
"""

from __future__ import annotations

import socket

from dlo.plan.profile import Accelerator, Interconnect, NodeProfile, nominal_collective_bps, nominal_h2d_bps


def local_profile(device: str) -> NodeProfile:
    from dlo.engine.devices import device_facts

    f = device_facts(device)
    acc = Accelerator(vendor=f.vendor, model=f.model, count=f.count, memory_bytes=f.memory_bytes)
    h2d = nominal_h2d_bps(f.model) if f.vendor != "none" else 0
    coll = nominal_collective_bps(f.model, f.interconnect, None) if f.vendor != "none" else 0
    return NodeProfile(
        node=socket.gethostname(), accelerator=acc,
        interconnect=Interconnect(kind=f.interconnect, collective_bandwidth_bps=coll),
        h2d_bandwidth_bps=h2d, host_memory_bytes=f.host_memory_bytes,
        can_register_page_cache=f.vendor == "nvidia",  # the engine DMAs from the page cache on cuda
    )
