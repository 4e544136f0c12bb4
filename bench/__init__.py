"""The benchmarks: one package, one entry (`python -m bench SUITE ...`, `bench/__main__.py`), one
record format (`bench/lib/`), results and notes beside them (`bench/results/`, `bench/NOTES.md`).

Map (`python -m bench` lists the suites):
- the entry and its tools: `__main__`; `tools` (stamp), `lockfile` (lock, wheels), `readme` with
  `readme_figures` and `readme_pipelines` (the README's figures), `suite_times` (tests);
  `device.sh`: the device prelude every GPU call runs its command through.
- `lib/`: provenance, packages (the lock), stats (spreads), records, the one merge, cards (each
  result's card), device_env (the prelude's private site).
- one card: `offload` + `offload_systems`; `wan_bench` (the Wan2.1-14B-shaped checkpoint, workloads,
  timers) and `_env` (NVLink multicast off) shared by the GPU suites.
- several cards: `multi_gpu` + `multi_gpu_record`, `sp` + `sp_record`, `hsdp` + `hsdp_ranks`, `ranks`
  (the rank group they share), `peer_check`, `serve`.
- whole pipelines: `pipeline` + `pipeline_record`, `pipeline_requests`, `diffusers_baseline`,
  `small_gpu`, `model_folders`, `sparse_pipeline`, `host_memory`; `exact_device`; `step_cache` (served step caches against uncached and diffusers' own); `memory` +
  `memory_probe`; `startup` + `startup_record`, `spy_profile`, `import_profile`; `seed_models` +
  `seed_models_record`, `seed_baseline`, `video_figures`; `lora` + `lora_record`, `lora_blocks`,
  `lora_merge_kernel`; `fp8_drift`; `cold_start` + `cgroup_memory`.
- CPU: `fetch`, `load_tiny`, `reliability_faults`, `reliability_attacks` (+ `reliability_attacks_agent`,
  `reliability_attacks_edges`, `reliability_attacks_serve`, `reliability_probe`), `operator_fleet`.
- beside the package: `peaks_plan` (with `peaks_device.sh`, the decode-peak calls).

Must never: import torch or dlo at import time (the device prelude imports this package first).
"""
