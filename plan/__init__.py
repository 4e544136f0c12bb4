"""dlo.plan: the deployment plan, torch-free.

Map: `facts` (mode names, model facts), `errors` (ConfigError), `limits` (what requests a server
accepts), `limits_fit` (limits a budget fits), `derive` (limits derived when none are given: resident,
the default requests plain, then fitting), `memory_table` +
`memory_table.json` (measured device peaks), `measured` (peaks measured on the serving device,
cached per device, model and library versions), `peak_values` (`AtLeast`: a shape that ran out of
memory; bounds of unmeasured shapes by measured ones), `memory_model` (a pipeline's memory at its limits),
`memory_plan` (tiling rule, resident blocks), `resident` (the resident plan a rank receives),
`profile` (a node's profile), `mode_estimates` + `policy` (memory and time per mode, the choice),
`budget` (a device budget and a given mode's check), `deployment` (`plan(...) -> DeploymentPlan`:
the one entry), `folder` (the torch-free readers of a model folder the plan needs).

Must never: import torch, the engine's torch modules, `dlo.serving`, `dlo.agent` or `dlo.operator`.
"""
