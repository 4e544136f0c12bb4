"""The adapters of a `--lora-dir`, and whether each one fits the model: torch-free where the file allows.

Owns: the folder's entries (`find_adapters`: `NAME.safetensors`, or `NAME/` holding one weight file
chosen as diffusers' loader chooses it, `pytorch_lora_weights.safetensors` first), the scaling rule
diffusers 0.42 + peft 0.21 apply (`PeftRule`: the file's `lora_adapter_metadata`, else Flux's
`.alpha` keys, else alpha = rank, i.e. scale 1.0), the check of one adapter's keys and shapes
against the transformer's checkpoint (`plan_adapter`: every refusal an `AdapterError` naming the
file and the key; a rank above its layer's dimensions, an alpha or a pattern `dlo.engine.lora.limits`
refuses, among them), and what the memory plan counts for them (`rank_device_bytes`, the merges'
bytes). `check_adapters`, what `dlo serve` runs before any rank starts, is `dlo.engine.lora.check`'s.
Must never: import torch at module import, or accept what diffusers + peft would load differently
(a peft folder, DoRA/LoKr, text-encoder keys, a metadata rank that disagrees with the tensors, bias
keys peft would drop): those are refused, never approximated.

A diffusers-format file (every key `transformer.<module>.lora_A.weight`, `.lora_B.weight` or
`.lora_B.bias`: `passes_through`) is checked from its header alone; any other file goes through the
family's diffusers converter (`dlo.engine.lora.weights.read_adapter`, torch) and its output is
checked the same way (`plan_adapter` both).
"""

from __future__ import annotations

import collections
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from dlo.engine.checkpoint import TensorInfo
from dlo.engine.lora.errors import AdapterError

PREFIX = "transformer."  # diffusers' `transformer_name` for every family
WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY
# Words diffusers' `_best_guess_weight_name` skips in a folder's file names.
_NOT_WEIGHTS = ("scheduler", "optimizer", "checkpoint")
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_B\.bias)$")
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


@dataclass(frozen=True)
class AdapterEntry:
    """One adapter of the folder: its name (the API's `lora`) and its weight file."""

    name: str
    path: Path


def find_adapters(lora_dir: Path | str) -> list[AdapterEntry]:
    """The adapters of `lora_dir`, by name: `NAME.safetensors` files and `NAME/` folders (other files
    and hidden entries are ignored)."""
    root = Path(lora_dir)
    if not root.is_dir():
        raise AdapterError(root, "--lora-dir is not a folder")
    entries: dict[str, AdapterEntry] = {}
    for p in sorted(root.iterdir()):
        if p.name.startswith("."):
            continue
        if p.is_dir():
            entry = AdapterEntry(p.name, _weight_file(p))
        elif p.suffix == ".safetensors":
            entry = AdapterEntry(p.stem, p)
        else:
            continue
        if not NAME.match(entry.name):
            raise AdapterError(p, f"adapter name {entry.name!r} must be 1-64 letters, digits, '.', '_' or '-' "
                                  "(starting with a letter or digit): it is the API's `lora` and part of the "
                                  "model id MODEL:NAME")
        if entry.name in entries:
            raise AdapterError(p, f"adapter {entry.name!r} is also {entries[entry.name].path}; keep one")
        entries[entry.name] = entry
    return list(entries.values())


def _weight_file(folder: Path) -> Path:
    preferred = folder / WEIGHT_NAME
    if preferred.is_file():
        return preferred
    if (folder / "adapter_config.json").exists():
        raise AdapterError(folder, "a peft adapter folder (adapter_config.json): diffusers' load_lora_weights "
                                   "does not read it either; save the adapter with the pipeline's "
                                   "save_lora_weights (keys transformer.<module>.lora_A.weight)")
    found = sorted(p for p in folder.glob("*.safetensors") if not any(w in p.name for w in _NOT_WEIGHTS))
    if len(found) == 1:
        return found[0]
    if not found:
        raise AdapterError(folder, f"no weight file (expected {WEIGHT_NAME})")
    raise AdapterError(folder, f"{len(found)} weight files ({', '.join(p.name for p in found)}): name the adapter's "
                               f"{WEIGHT_NAME} or keep one")


# ---- the scaling rule --------------------------------------------------------------------------
def pattern_key(patterns: Mapping[str, Any], module: str) -> str:
    """peft's `get_pattern_key`: the first pattern that matches the end of `module` at a dot boundary."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


@dataclass(frozen=True)
class PeftRule:
    """The `LoraConfig` fields that decide each module's rank and scaling (peft: alpha / r, or
    alpha / sqrt(r) with rsLoRA). `lora_alpha` and the alpha patterns hold floats, or the 0-dim
    tensors of a Flux file's `.alpha` keys (peft then computes the scaling as a tensor)."""

    r: int
    lora_alpha: Any
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, Any] = field(default_factory=dict)
    use_rslora: bool = False
    lora_bias: bool = False

    def rank(self, module: str) -> int:
        return self.rank_pattern.get(pattern_key(self.rank_pattern, module), self.r)

    def scaling(self, module: str) -> Any:
        r = self.rank(module)
        alpha = self.alpha_pattern.get(pattern_key(self.alpha_pattern, module), self.lora_alpha)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], path: Path) -> "PeftRule":
        """From the file's `lora_adapter_metadata` (LoraConfig kwargs; peft's defaults r=8, alpha=8)."""
        if meta.get("use_dora"):
            raise AdapterError(path, "DoRA adapters (use_dora) are not supported")
        for unsupported in ("target_parameters", "layer_replication", "alora_invocation_tokens"):
            if meta.get(unsupported):
                raise AdapterError(path, f"metadata {unsupported} is not supported")
        r, alpha = meta.get("r", 8), meta.get("lora_alpha", 8)
        ranks, alphas = meta.get("rank_pattern") or {}, meta.get("alpha_pattern") or {}
        if not (_whole(r) and _number(alpha) and isinstance(ranks, dict) and isinstance(alphas, dict)
                and all(_whole(v) for v in ranks.values()) and all(_number(v) for v in alphas.values())):
            raise AdapterError(path, f"metadata {METADATA_KEY} has an invalid r, lora_alpha, rank_pattern or "
                                     "alpha_pattern")
        return cls(r, float(alpha), dict(ranks), {k: float(v) for k, v in alphas.items()},
                   bool(meta.get("use_rslora", False)), bool(meta.get("lora_bias", False)))

    @classmethod
    def from_tensors(cls, ranks: Mapping[str, int], alphas: Mapping[str, Any], bias: bool) -> "PeftRule":
        """diffusers' `get_peft_kwargs` without metadata: the most common rank, the others as a
        pattern; alpha = rank (scale 1.0) unless the file has alphas (Flux), the most common of them
        and the others as a pattern."""
        rank_dict = {f"^{m}": r for m, r in ranks.items()}
        r = lora_alpha = next(iter(rank_dict.values()))
        rank_pattern: dict[str, int] = {}
        alpha_pattern: dict[str, Any] = {}
        if len(set(rank_dict.values())) > 1:
            r = collections.Counter(rank_dict.values()).most_common()[0][0]
            rank_pattern = {k: v for k, v in rank_dict.items() if v != r}
            if not alphas:
                lora_alpha, alpha_pattern = r, dict(rank_pattern)
        if alphas:
            if len(set(alphas.values())) > 1:
                lora_alpha = collections.Counter(alphas.values()).most_common()[0][0]
                alpha_pattern = {k: v for k, v in alphas.items() if bool(v != lora_alpha)}
            else:
                lora_alpha = set(alphas.values()).pop()
        return cls(r, lora_alpha, rank_pattern, alpha_pattern, False, bias)


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# ---- one adapter against the model -------------------------------------------------------------
@dataclass(frozen=True)
class ModulePlan:
    """One targeted linear layer: its path in the transformer, the adapter's rank there, its
    features, whether the branch has a bias, and the bytes per element of the layer's weight."""

    module: str
    rank: int
    in_features: int
    out_features: int
    bias: bool
    itemsize: int

    @property
    def nbytes(self) -> int:
        """Device bytes of the branch in the layer's dtype (A, B and the bias)."""
        return (self.rank * (self.in_features + self.out_features) + self.out_features * self.bias) * self.itemsize


@dataclass(frozen=True)
class AdapterPlan:
    """An adapter that fits the model: every module it targets, and its scaling rule."""

    name: str
    path: Path
    modules: tuple[ModulePlan, ...]
    rule: PeftRule

    @property
    def device_bytes(self) -> int:
        return sum(m.nbytes for m in self.modules)


def _foreign_key(path: Path, key: str) -> AdapterError:
    if key.startswith("base_model.model."):
        return AdapterError(path, f"key {key}: a peft checkpoint (get_peft_model(...).save_pretrained); diffusers' "
                                  "load_lora_weights loads nothing of it; save it with the pipeline's save_lora_weights")
    if key.startswith(("text_encoder", "lora_te")):
        return AdapterError(path, f"key {key}: text-encoder LoRA is not supported (adapters apply to the transformer)")
    return AdapterError(path, f"key {key} does not start with {PREFIX!r}: it names no part of the transformer")


def plan_adapter(entry: AdapterEntry, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str],
                 metadata: Mapping[str, Any] | None, alphas: Mapping[str, Any] | None,
                 weights: Mapping[str, TensorInfo]) -> AdapterPlan:
    """Check one adapter (its keys after diffusers' conversion, with shapes and safetensors dtype
    names; its parsed metadata; Flux's `.alpha` values by module) against the transformer's
    checkpoint tensors `weights`; the plan, or `AdapterError` naming the file and the key."""
    path = entry.path
    if metadata and alphas:
        raise AdapterError(path, "both lora_adapter_metadata and .alpha keys: diffusers refuses such a file")
    parts: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        if not key.startswith(PREFIX):
            raise _foreign_key(path, key)
        m = _KEY.match(key[len(PREFIX):])
        if m is None:
            what = ("DoRA" if "lora_magnitude_vector" in key else "LoKr" if ".lokr_" in key else None)
            raise AdapterError(path, f"key {key}: " + (f"{what} adapters are not supported" if what else
                                                       "not a LoRA weight (lora_A.weight, lora_B.weight, lora_B.bias)"))
        if dtypes[key] not in _FLOAT_DTYPES:
            raise AdapterError(path, f"key {key}: dtype {dtypes[key]} is not a float type")
        parts.setdefault(m["module"], {})[m["part"]] = shape
    if not parts:
        raise AdapterError(path, "no transformer LoRA weights in the file")
    alphas = {k.removesuffix(".alpha"): v for k, v in (alphas or {}).items()}
    ranks = {module: _rank(path, module, p) for module, p in parts.items()}
    # diffusers counts ranks in the order of the lora_B keys (most_common breaks ties by it)
    order = [_KEY.match(k[len(PREFIX):])["module"] for k in shapes if k.endswith(".lora_B.weight")]
    ranks = {module: ranks[module] for module in order}
    if metadata:
        rule = PeftRule.from_metadata(metadata, path)
    else:
        rule = PeftRule.from_tensors(ranks, alphas, any("lora_B.bias" in p for p in parts.values()))
    from dlo.engine.lora.limits import check_alpha, check_patterns

    check_alpha(path, [rule.lora_alpha, *rule.alpha_pattern.values()])
    for field_name, patterns in (("rank_pattern", rule.rank_pattern), ("alpha_pattern", rule.alpha_pattern)):
        check_patterns(path, field_name, patterns, parts)  # before any `re` match of them runs
    modules = tuple(_module_plan(path, module, p, ranks[module], rule, weights) for module, p in parts.items())
    return AdapterPlan(entry.name, path, modules, rule)


def _rank(path: Path, module: str, p: Mapping[str, tuple[int, ...]]) -> int:
    if "lora_A.weight" not in p or "lora_B.weight" not in p:
        raise AdapterError(path, f"module {module}: needs both lora_A.weight and lora_B.weight")
    a, b = p["lora_A.weight"], p["lora_B.weight"]
    if len(a) != 2 or len(b) != 2 or a[0] != b[1] or a[0] < 1:
        raise AdapterError(path, f"module {module}: lora_A {list(a)} and lora_B {list(b)} are not (r, in) and "
                                 "(out, r) of one rank r")
    return a[0]


def _module_plan(path: Path, module: str, p: Mapping[str, tuple[int, ...]], rank: int, rule: PeftRule,
                 weights: Mapping[str, TensorInfo]) -> ModulePlan:
    base = weights.get(f"{module}.weight")
    if base is None:
        raise AdapterError(path, f"module {module}: the transformer has no {module}.weight (a target module the "
                                 "model does not have)")
    if len(base.shape) != 2:
        raise AdapterError(path, f"module {module}: not a linear layer (its weight is {list(base.shape)})")
    out_f, in_f = base.shape
    if rank > min(in_f, out_f):
        raise AdapterError(path, f"module {module}: rank {rank} exceeds the layer's {in_f} inputs or {out_f} outputs "
                                 "(a LoRA's rank is at most the smaller)")
    if p["lora_A.weight"][1] != in_f or p["lora_B.weight"][0] != out_f:
        raise AdapterError(path, f"module {module}: lora_A {list(p['lora_A.weight'])} and lora_B "
                                 f"{list(p['lora_B.weight'])} do not fit the layer's {in_f} inputs and {out_f} outputs")
    if "lora_B.bias" in p and p["lora_B.bias"] != (out_f,):
        raise AdapterError(path, f"module {module}: lora_B.bias {list(p['lora_B.bias'])} is not ({out_f},)")
    if "lora_B.bias" in p and not rule.lora_bias:
        raise AdapterError(path, f"module {module}: lora_B.bias, but the metadata says lora_bias false (peft "
                                 "would drop it)")
    if rule.rank(module) != rank:
        raise AdapterError(path, f"module {module}: the metadata says rank {rule.rank(module)}, the tensors have {rank}")
    from dlo.engine.checkpoint import DTYPE_SIZES

    return ModulePlan(module, rank, in_f, out_f, rule.lora_bias, DTYPE_SIZES[base.dtype])


# ---- what `dlo serve` checks at start ----------------------------------------------------------
def passes_through(keys: Mapping[str, Any]) -> bool:
    """Whether every key is diffusers' own format, which each family's loader takes unconverted."""
    return all(k.startswith(PREFIX) and _KEY.match(k[len(PREFIX):]) for k in keys)


def parse_metadata(path: Path, header_metadata: Mapping[str, str]) -> dict[str, Any] | None:
    """The LoraConfig kwargs of the file (`transformer.`-prefixed keys, prefix removed), or None."""
    raw = header_metadata.get(METADATA_KEY)
    if not raw:
        return None
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise AdapterError(path, f"metadata {METADATA_KEY} is not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise AdapterError(path, f"metadata {METADATA_KEY} is not a JSON object")
    return {k[len(PREFIX):]: v for k, v in meta.items() if k.startswith(PREFIX)} or None


def rank_device_bytes(plans: Iterable[AdapterPlan], apply: str = "branch", merge_cache_bytes: int = 0,
                      kept_blocks: tuple[str, ...] = ()) -> int:
    """Device bytes every rank holds for `plans`: the adapters' tensors and, with `--lora-apply merge|auto`,
    the merge scratch twice (`dlo.engine.lora.merge.MergeScratch`: the largest targeted weight and lora
    bias per element size; the second is the look-ahead's, `ahead.MergeAhead`, made where blocks stream
    on cuda) and the merge cache, up to what every adapter's merges would fill (a larger cache could
    never be used). With `kept_blocks` (CFG pairs: the model's block lists) the look-ahead's scratch
    gives way to a block's merges kept (`block_merges_bytes`). What the device budget counts as a
    whole component (`lora_adapters`)."""
    plans = list(plans)
    total = sum(p.device_bytes for p in plans)
    if apply == "branch" or not plans:
        return total
    modules = [m for p in plans for m in p.modules]
    weights, biases = merge_scratch_elements((m.itemsize, m.out_features, m.in_features, m.bias) for m in modules)
    scratch = sum(n * size for part in (weights, biases) for size, n in part.items())
    second = block_merges_bytes(plans, kept_blocks) if kept_blocks else scratch
    return total + min(merge_cache_bytes, all_merges_bytes(plans)) + scratch + second


def block_merges_bytes(plans: Iterable[AdapterPlan], block_lists: tuple[str, ...]) -> int:
    """Bytes of one block's merges kept for CFG pairs' second lane (`block_merges.BlockMerges`): per
    layer of a block (its path below the block: `attn1.to_q`), the largest merge any adapter makes
    there. Layers outside `block_lists` are resident and merge into the scratch."""
    largest: dict[str, int] = {}
    for m in (m for p in plans for m in p.modules):
        for name in block_lists:
            head, _, rest = m.module.partition(name + ".")
            index, _, layer = rest.partition(".")
            if head == "" and index.isdigit() and layer:
                size = merge_bytes(m.out_features, m.in_features, m.bias, m.itemsize)
                largest[f"{name}:{layer}"] = max(largest.get(f"{name}:{layer}", 0), size)
                break
    return sum(largest.values())


def all_merges_bytes(plans: Iterable[AdapterPlan]) -> int:
    """Bytes of every layer's merge for every adapter of `plans` at one scale: the most a merge cache
    could hold (an auto cache is sized up to it)."""
    return sum(merge_bytes(m.out_features, m.in_features, m.bias, m.itemsize) for p in plans for m in p.modules)


def merge_bytes(out: int, inp: int, bias: bool, itemsize: int) -> int:
    """Bytes of one layer's merge: its (out x in) weight and, with a lora bias, its bias. One rule for
    what the merge cache keeps (`bank.LoraBank`) and what the budget counts of it (`rank_device_bytes`)."""
    return (out * inp + (out if bias else 0)) * itemsize


def merge_scratch_elements(layers: Iterable[tuple[Any, int, int, bool]]) -> tuple[dict[Any, int], dict[Any, int]]:
    """Elements of the merge scratch per kind of element (a dtype, or its size where torch is not
    imported): the largest (out x in) weight and the largest lora bias among `layers`, each given as
    (kind, out features, in features, has a lora bias). One rule for the engine's buffers
    (`merge.MergeScratch`) and the budget's count of them (`rank_device_bytes`)."""
    weights: dict[Any, int] = {}
    biases: dict[Any, int] = {}
    for kind, out, inp, bias in layers:
        weights[kind] = max(weights.get(kind, 0), out * inp)
        if bias:
            biases[kind] = max(biases.get(kind, 0), out)
    return weights, biases
