"""Per-request LoRA adapters on the offloaded (and resident) transformer, as unmerged low-rank branches.

An adapter is a `NAME.safetensors` file or a `NAME/` folder of `dlo serve --lora-dir DIR`, in the
format diffusers' `load_lora_weights` reads for the family (diffusers/peft keys, or a community
format diffusers converts). Every adapter is checked at start against the transformer's checkpoint
(`check.check_adapters`, torch-free for diffusers-format files), then loaded once per rank onto
its device (`bank.LoraBank`): for a request that names it, a forward hook on each targeted
`nn.Linear` adds `round(round(round(x A^T) B^T + b) * scaling)` to the layer's output, in peft's own
op order, so a request equals diffusers + peft for the same seed while the gathered base weights (the
shared slot) are never touched. Requests with different adapters (or none) therefore share one wave.

Modules: `adapters` (torch-free: the folder's entries, the peft scaling rule, one adapter's
checks), `check` (torch-free: every adapter of the folder checked at start), `weights` (reading a
file through the family's diffusers loader; the branch tensors), `bank` (the adapters of one rank
and their hooks), `merge` (a request's adapter merged into the weight a layer computes with, per
call), `merge_steps` (peft's two torch steps: the bytes every merge gives), `merge_kernel` (the same
in one Triton pass on cuda), `ahead` (the next streamed layer's merge on a side stream),
`block_merges` (a streamed block's merges kept for CFG pairs' second lane), `limits` (the values,
alphas and patterns an adapter may hold: refused at the start check), `errors` (`AdapterError`).
`dlo make-random-lora` is `dlo.engine.random_lora`.
Must never: import peft (diffusers imports it whenever it is installed: the engine image has none),
write into a model weight or a slot, keep a hook after the request that installed it, or import
torch at package import (`dlo serve` checks adapters before any rank starts).
"""

from dlo.engine.lora.adapters import (
    AdapterError,
    AdapterPlan,
    all_merges_bytes,
    find_adapters,
    rank_device_bytes,
)
from dlo.engine.lora.check import check_adapters

__all__ = ["AdapterError", "AdapterPlan", "all_merges_bytes", "check_adapters", "find_adapters", "rank_device_bytes"]
