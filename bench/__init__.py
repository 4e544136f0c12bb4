"""The benchmarks: one package, one entry (`python -m bench SUITE ...`, `bench/__main__.py`), one
record format (`bench/lib/`), results and notes beside them (`bench/results/`, `bench/NOTES.md`).

Map:
- `__main__`: the entry and the list of suites and tools.
- `lib/`: provenance, packages (the lock), stats (spreads), records, the one merge, the device prelude's site.
- `device.sh`: the device prelude every GPU call runs its command through.
- `tools`: stamp.
- `offload` + `offload_systems`: one GPU, DLO against resident, diffusers and accelerate at the physical bound.
- `wan_bench`: the Wan2.1-14B-shaped checkpoint, workloads and timers the GPU suites share.
- `_env`: NVLink multicast off for every benchmark process.

Must never: import torch or dlo at import time (the device prelude imports this package first).
"""
