"""The per-block half of `bench/lora.py`, in its own process (its device memory is its own).

`python -m bench.lora_blocks MODEL_DIR LORA_DIR --device cuda --tokens 4096,7800,32760` loads the
pipeline's transformer resident through `dlo.engine.load`, the adapters of LORA_DIR (`r64`: every
block linear; `r64-attention`: the attention projections) through the engine's own `LoraBank`, and
times one transformer forward per variant and token count with an event pair around every block:

- `base` (no adapter), `lora` (the engine's path at scale 1: no multiply), `lora_scale_0.8` (the
  multiply), `lora_attention` (attention projections only);
- `lora_separate_add` (the engine's cpu order on this device: B's product rounded, then added to
  the output; on cuda the engine adds in B's GEMM instead, which must give the same bytes:
  `bit_identical_to_lora`);
- `lora_unfolded` (the engine's `lora` run as a scaling of 0.5 over 2B: the multiply the power-of-two
  fold removes, whose output must equal `lora` bit for bit on this device);
- `merge` (`--lora-apply merge`: each layer computes with W + B A merged into a scratch, in peft's
  two steps: B A rounded, then W added) and `merge_in_gemm` (bench only: W + B A as one `addmm`,
  half the passes over W), whose bytes against `merge`'s (`bit_identical_to_merge`) and time decide
  whether the engine should take it (`[Note: LoRA merge order]` in `dlo.engine.lora.merge`).

Prints one JSON object: the adapters' device bytes (allocator delta) and host bytes (anonymous PSS
delta of this process, and its peak) per adapter, load seconds, and per token count and variant the
mean block time, the forward time and the output's SHA-256 (`bit_identical_to_lora`).
Must never: time anything the engine does not run, except the variants named bench only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

from bench import wan_bench as wb

TEXT_TOKENS = 512


def wan_inputs(config: dict, tokens: int, device: str, text_tokens: int) -> dict:
    """Latents of `tokens` patches of 1x2x2: 832x480 video at 17 and 81 frames (5 and 21 latent
    frames of 60 x 104), else one square frame."""
    import torch

    video = {7800: 5, 32760: 21}.get(tokens)
    side = 2 * round(tokens ** 0.5)
    shape = (video, 60, 104) if video else (1, side, side)
    g = torch.Generator(device).manual_seed(1)
    return dict(hidden_states=torch.randn((1, config["in_channels"], *shape), generator=g, device=device),
                timestep=torch.tensor([500], device=device),
                encoder_hidden_states=torch.randn((1, text_tokens, config["text_dim"]), generator=g, device=device),
                return_dict=False)


def flux_inputs(config: dict, tokens: int, device: str, text_tokens: int) -> dict:
    import torch

    g = torch.Generator(device).manual_seed(1)
    ids = torch.zeros(tokens, 3, device=device)
    return dict(hidden_states=torch.randn((1, tokens, config["in_channels"]), generator=g, device=device),
                encoder_hidden_states=torch.randn((1, text_tokens, config["joint_attention_dim"]), generator=g,
                                                  device=device),
                pooled_projections=torch.randn((1, config["pooled_projection_dim"]), generator=g, device=device),
                timestep=torch.tensor([0.5], device=device), img_ids=ids, txt_ids=torch.zeros(text_tokens, 3, device=device),
                guidance=torch.tensor([3.5], device=device) if config.get("guidance_embeds") else None,
                return_dict=False)


INPUTS = {"WanTransformer3DModel": wan_inputs, "FluxTransformer2DModel": flux_inputs}


class BlockTimer:
    """Milliseconds of every block of one forward: CUDA events on the compute stream, else the clock."""

    def __init__(self, blocks: list, cuda: bool):
        import torch

        self.cuda, self.torch, self.marks = cuda, torch, []
        for b in blocks:
            b.register_forward_pre_hook(lambda *_: self.marks.append(self._mark()))
            b.register_forward_hook(lambda *_: self.marks.append(self._mark()))

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        e = self.torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def block_ms(self) -> list[float]:
        pairs = list(zip(self.marks[::2], self.marks[1::2]))
        self.marks = []
        if self.cuda:
            self.torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in pairs]
        return [(b - a) * 1e3 for a, b in pairs]


def separate_add(bank: Any) -> Any:
    """The same adapters with B's product and the add as two steps (the engine's cpu order)."""
    from dlo.engine.lora.bank import LoraBank

    return LoraBank(bank.adapters, add_in_gemm=False)


def unfolded(bank: Any, name: str) -> Any:
    """The adapter as scaling 0.5 over 2B (exact): what the engine runs before its power-of-two fold."""
    from dlo.engine.lora.bank import LoraBank
    from dlo.engine.lora.weights import Branch

    return LoraBank({"x": {layer: Branch(b.A, b.B * 2, b.bias * 2 if b.bias is not None else None, 0.5)
                           for layer, b in bank.adapters[name].items()}}, add_in_gemm=bank.add_in_gemm)


def merged(bank: Any, in_gemm: bool, device: Any) -> Any:
    """The same adapters merged per call into a scratch (`--lora-apply merge`), in one GEMM or as the
    engine merges by default (`--lora-merge-kernel`'s default)."""
    from dlo.engine.lora.bank import LoraBank, merge_way
    from dlo.engine.lora.merge import MergeScratch
    from dlo.engine.settings import LoraSettings

    scratch = MergeScratch((b for br in bank.adapters.values() for b in br.values()), device)
    way = dataclasses.replace(merge_way(LoraSettings(), device), in_gemm=in_gemm)
    return LoraBank(bank.adapters, scratch=scratch, way=way)


def measure(args: argparse.Namespace) -> dict:
    import torch

    import dlo.engine
    from dlo.engine.families import pipeline_facts
    from dlo.engine.settings import OffloadSettings

    cuda = args.device.startswith("cuda")
    model_dir, lora_dir = Path(args.model_dir), Path(args.lora_dir)
    facts = pipeline_facts(model_dir)
    t0 = time.perf_counter()
    model = dlo.engine.load(model_dir / "transformer", settings=OffloadSettings("resident"), device=args.device)
    out: dict[str, Any] = {"load_seconds": round(time.perf_counter() - t0, 2), "adapters": {}, "workloads": {}}
    banks = {}
    import diffusers

    getattr(diffusers, facts.pipeline_class)  # the loader's modules imported before any byte is counted
    for name in sorted(p.name for p in lora_dir.iterdir() if not p.name.startswith(".")):
        banks[name], out["adapters"][name] = _load_measured(lora_dir, name, facts.pipeline_class,
                                                            model_dir / "transformer", model, cuda)
    full, attention = banks["r64"], banks.get("r64-attention")
    variants: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
        "base": contextlib.nullcontext, "lora": lambda: full.applied("r64", 1.0),
        "lora_scale_0.8": lambda: full.applied("r64", 0.8), "lora_separate_add": lambda: separate_add(full).applied("r64", 1.0),
        "lora_unfolded": lambda: unfolded(full, "r64").applied("x", 1.0)}
    merge_banks = {"merge": merged(full, False, model.device),
                   "merge_in_gemm": merged(full, True, model.device)}
    variants.update({n: (lambda b=b: b.applied("r64", 1.0)) for n, b in merge_banks.items()})
    if attention is not None:
        variants["lora_attention"] = lambda: attention.applied("r64-attention", 1.0)
    family = facts.adapter.blocks
    blocks = [b for list_name in family.block_lists for b in model.module.get_submodule(list_name)]
    timer = BlockTimer(blocks, cuda)
    config = json.loads((model_dir / "transformer" / "config.json").read_text())
    for tokens in args.tokens:
        inputs = INPUTS[config["_class_name"]](config, tokens, args.device, args.text_tokens)
        inputs = {k: (v.to(model.compute_dtype) if torch.is_tensor(v) and v.is_floating_point() and "ids" not in k
                      else v) for k, v in inputs.items()}
        out["workloads"][str(tokens)] = row = {}
        for name, ctx in variants.items():
            row[name] = _time_variant(model.module, inputs, ctx, timer, args)
        for name, r in row.items():
            r["bit_identical_to_lora"] = r["sha256"] == row["lora"]["sha256"]
            if name.startswith("merge"):
                r["bit_identical_to_merge"] = r["sha256"] == row["merge"]["sha256"]
        print(f"{tokens} tokens: " + ", ".join(f"{n} {r['block_ms']:.3f} ms" for n, r in row.items()), file=sys.stderr)
    return out


def _load_measured(lora_dir: Path, name: str, pipeline_class: str, transformer_dir: Path, model: Any,
                   cuda: bool) -> tuple[Any, dict]:
    """One adapter loaded as `dlo serve` loads it (`LoraBank.load` of a folder holding only it), with
    what it costs: device bytes (its tensors, and the allocator's delta), host bytes (anonymous PSS of
    this process after the load and at its peak during it, sampled every 20 ms) and seconds."""
    import threading

    import torch

    from dlo.engine.lora.bank import LoraBank
    from dlo.engine.settings import LoraSettings

    single = lora_dir / f".{name}"  # a folder holding only this adapter (hidden: not an adapter itself)
    single.mkdir(exist_ok=True)
    if not (single / name).exists():
        (single / name).symlink_to(lora_dir / name)
    anon = lambda: wb.smaps_rollup().get("Pss_Anon", 0)  # noqa: E731
    host0, peak, done = anon(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], anon())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    dev0 = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    # the adapter's own bytes: the branch (merge and auto add one scratch per rank, counted apart)
    bank = LoraBank.load(LoraSettings(str(single), apply="branch"), pipeline_class, transformer_dir, model,
                         model.device)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    after = anon()
    return bank, {"seconds": round(seconds, 2), "device_bytes": bank.device_bytes,
                  "allocated_bytes": (torch.cuda.memory_allocated() - dev0) if cuda else None,
                  "host_anon_bytes_after": after - host0, "host_anon_bytes_peak": max(peak[0], after) - host0,
                  "file_bytes": sum(f.stat().st_size for f in (lora_dir / name).rglob("*.safetensors")),
                  "layers": len(bank.adapters[name])}


def _time_variant(module: Any, inputs: dict, ctx: Callable, timer: BlockTimer, args: argparse.Namespace) -> dict:
    import torch

    blocks, forwards, sha = [], [], ""
    with torch.inference_mode(), ctx():
        for i in range(args.warmup + args.iters):
            t0 = time.perf_counter()
            y = module(**inputs)[0]
            per_block = timer.block_ms()  # synchronizes on cuda
            if i >= args.warmup:
                forwards.append((time.perf_counter() - t0) * 1e3)
                blocks.append(statistics.mean(per_block))
            sha = hashlib.sha256(y.float().cpu().numpy().tobytes()).hexdigest()
    return {"block_ms": round(statistics.median(blocks), 4), "forward_ms": round(statistics.median(forwards), 2),
            "block_ms_runs": [round(b, 4) for b in blocks], "sha256": sha}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench x", description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("lora_dir", help="r64/ (every block linear) and r64-attention/ (optional), as bench/lora.py writes")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[4096])
    ap.add_argument("--text-tokens", type=int, default=TEXT_TOKENS)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=2)
    args = ap.parse_args(argv)
    import torch

    torch.manual_seed(0)
    print(json.dumps(measure(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
