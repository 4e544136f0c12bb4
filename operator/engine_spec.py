"""`spec.engine` of a DLODeployment: which server runs, its image, device and engine switches.

Owns: `EngineSpec` (with `engine_switches()`, the `dlo serve` flags of its typed switches),
`StepCacheSpec` (`spec.engine.cache`: the step cache of a request that names none),
`SecretKeyRef` (one API key), `ApiKeys` (named keys, one tenant each: a Secret mounted read-only for
`dlo serve --api-keys`), the variables the engine reads its API key from, and their rules (Python
and CEL).
Must never: talk to the API server or import torch.
"""

from __future__ import annotations

import argparse
import json
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from dlo.cli.args import DNS_LABEL, dns_label
from dlo.engine.settings import (FACTORS_DTYPES, MAX_GATHER_CTAS, PRESETS, CacheSpecError, StreamDtype, Transfer,
                                 UlyssesExchange, cache_spec)
from dlo.operator.k8s_schemas import cel_rules, kubernetes_field
from dlo.operator.spec_base import SpecModel as _Model

VLLM_API_KEY_ENV = "VLLM_API_KEY"  # where vLLM (engine.kind vllm-omni) reads its API key
API_KEY_ENV = "DLO_API_KEY"  # the engine reads its API key from this variable


class SecretKeyRef(_Model):
    """A key of a Secret in the resource's namespace."""

    name: str = Field(min_length=1, description="name of the Secret")
    key: str = Field("api-key", min_length=1, description="key in the Secret holding the API key")


class StepCacheSpec(_Model):
    """A step cache preset and the parameters set (`dlo serve --cache`; docs/serving.md, "Step caches"):
    checked as the engine checks it; a parameter left out takes the preset's default."""

    preset: Literal[tuple(PRESETS)] = Field(  # type: ignore[valid-type]
        description="first-block (diffusers' FirstBlockCache), taylorseer (TaylorSeer, lite) or mag (MagCache)")
    threshold: float | None = Field(None, ge=0, le=10, description="first-block, mag: the skip threshold (> 0)")
    cache_interval: int | None = Field(None, ge=1, le=1000, description="taylorseer: a full step every N")
    disable_cache_before_step: int | None = Field(None, ge=1, le=10000, description="taylorseer: full steps first")
    disable_cache_after_step: int | None = Field(None, ge=1, le=10000, description="taylorseer: full steps from")
    max_order: int | None = Field(None, ge=0, le=4, description="taylorseer: the Taylor expansion's order")
    factors_dtype: Literal[FACTORS_DTYPES] | None = Field(  # type: ignore[valid-type]
        None, description="taylorseer: the dtype its factors are kept in")
    mag_ratios: list[float] | None = Field(None, min_length=2, max_length=1000,
                                           description="mag (required): the model's ratios per calibration step")
    max_skip_steps: int | None = Field(None, ge=1, le=1000, description="mag: steps skipped in a row at most")
    retention_ratio: float | None = Field(None, ge=0, le=1, description="mag: the share of first steps run")

    @model_validator(mode="after")
    def _a_preset(self) -> StepCacheSpec:
        self.serve_value()
        return self

    def serve_value(self) -> str:
        """The value of `dlo serve --cache`: the preset and the parameters set, as JSON."""
        given = self.model_dump(exclude_none=True)
        try:
            cache_spec(given, "engine.cache")
        except CacheSpecError as e:  # said with the spec's names
            message = str(e)
            for name in sorted(type(self).model_fields, key=len, reverse=True):
                message = message.replace(name, to_camel(name))
            raise ValueError(message) from None
        return json.dumps(given, separators=(",", ":"))


MAX_ADMINS = 16


class ApiKeys(_Model):
    """Named API keys: every key of the Secret is a tenant, named by the key, whose API key is its
    value; each request is its key's tenant (its own video jobs and quotas)."""

    secret_name: str = Field(
        min_length=1, max_length=253,
        description="Secret in the resource's namespace whose every key is a tenant's name (a DNS label) and "
        "whose value is that tenant's API key; mounted read-only for `dlo serve --api-keys` (read at start: "
        "restart the pods after a change)")
    admins: list[str] = Field(
        default_factory=list, max_length=MAX_ADMINS,
        json_schema_extra={"items": {"type": "string", "pattern": DNS_LABEL, "maxLength": 63}},
        description="names of the Secret's keys whose requests see, fetch and delete every tenant's video "
        "jobs (`--admin-key`)")

    @field_validator("admins")
    @classmethod
    def _names(cls, admins: list[str]) -> list[str]:
        try:
            return [dns_label(a) for a in admins]
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"engine.apiKeys.admins: {e}") from None

    def serve_flags(self, mount: str) -> list[str]:
        """`dlo serve`'s flags for the Secret mounted at `mount`."""
        return ["--api-keys", mount, *(f for name in self.admins for f in ("--admin-key", name))]


_ONE_KEY_SOURCE_RULE = (
    "!has(self.apiKeys) || !has(self.apiKeySecret)",
    "set engine.apiKeySecret (one key) or engine.apiKeys (named keys, one tenant each), not both",
)
_API_KEYS_ENGINE_RULE = (
    "!has(self.apiKeys) || self.kind == 'dlo'",
    "engine.apiKeys (named keys) is dlo's: vllm-omni takes one key (engine.apiKeySecret)",
)


# A key set in engine.env would be written into the StatefulSet's pod template for anyone who reads it.
_API_KEY_ENV_RULE = (
    f"self.name != '{API_KEY_ENV}' && self.name != '{VLLM_API_KEY_ENV}'",
    f"engine.env must not set {API_KEY_ENV} or {VLLM_API_KEY_ENV}: put the key in a Secret and name it in "
    "engine.apiKeySecret",
)


# The engine switches that are typed fields of spec.engine (named like `dlo serve`'s flags): their
# variables in engine.env would be a second, unchecked home for the same setting.
ENGINE_SWITCH_ENV = {"DLO_GATHER": "gather", "DLO_GATHER_MAX_CTAS": "gatherMaxCtas",
                     "DLO_ULYSSES": "ulyssesExchange", "DLO_REGISTER_EARLY": "registerEarly"}
_SWITCH_ENV_RULE = (
    "!(self.name in [" + ", ".join(f"'{n}'" for n in ENGINE_SWITCH_ENV) + "])",
    "engine.env must not set " + ", ".join(ENGINE_SWITCH_ENV) + ": set the engine fields "
    + ", ".join(f"engine.{f}" for f in ENGINE_SWITCH_ENV.values()) + " instead",
)
# dlo's own switches mean nothing to vllm-omni
_DLO_SWITCHES_RULE = (
    "self.kind == 'dlo' || (!has(self.gather) && !has(self.gatherMaxCtas) && !has(self.ulyssesExchange)"
    " && !has(self.registerEarly) && !has(self.maxDeviceMemory) && !has(self.streamDtype) && !has(self.cache))",
    "engine.gather, gatherMaxCtas, ulyssesExchange, registerEarly, maxDeviceMemory, streamDtype and cache are "
    "dlo's switches: only with engine.kind dlo",
)
_BUDGET_DEVICE_RULE = (
    "!has(self.maxDeviceMemory) || self.device != 'cpu'",
    "engine.maxDeviceMemory is an accelerator's budget: not with engine.device cpu",
)
# `dlo serve --max-device-memory`'s syntax (dlo.cli.args.byte_size): bytes, or a number with a unit
BYTE_SIZE_PATTERN = r"^[0-9]+(\.[0-9]+)?([Bb]|[KkMmGgTt][Ii]?[Bb])?$"
# a cap of the weight gathers' NCCL communicator: NCCL runs on cuda only
_CTAS_DEVICE_RULE = (
    "!has(self.gatherMaxCtas) || self.device == 'auto' || self.device == 'cuda'",
    "engine.gatherMaxCtas caps NCCL's weight gathers: only with engine.device cuda or auto",
)


# vLLM flags vllm-omni (0.30.0) refuses under --omni: the operator sets the ranks (--num-gpus).
VLLM_OMNI_REFUSED_FLAGS = (
    "--data-parallel-address", "--data-parallel-backend", "--data-parallel-rpc-port", "--data-parallel-size",
    "--data-parallel-size-local", "--data-parallel-start-rank", "--enable-expert-parallel",
)


def _byte_count(text: str) -> int:
    """`text` as `dlo serve` parses --max-device-memory; ValueError with its one-line message."""
    import argparse

    from dlo.cli.args import byte_size

    try:
        return byte_size(text)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"engine.maxDeviceMemory: {e}") from None


class EngineSpec(_Model):
    """The engine container: which server, its image, device, engine switches, extra arguments and
    resources."""

    model_config = ConfigDict(json_schema_extra=cel_rules(_DLO_SWITCHES_RULE, _CTAS_DEVICE_RULE, _BUDGET_DEVICE_RULE,
                                                          _ONE_KEY_SOURCE_RULE, _API_KEYS_ENGINE_RULE))

    kind: Literal["dlo", "vllm-omni"] = Field(
        "dlo",
        description="dlo: `dlo serve` (probes /ready and /health, metrics dlo_*); vllm-omni: upstream "
        "`vllm serve --omni` (probes /health, metrics vllm:*, API key as VLLM_API_KEY)",
    )
    image: str | None = Field(
        None, min_length=1, description="engine image; default: the operator's default engine image"
    )
    device: Literal["auto", "cuda", "npu", "cpu"] = Field(
        "auto", description="device the dlo engine runs on (auto: cuda, else npu, else cpu); cpu requests no accelerator"
    )
    args: list[str] = Field(default_factory=list, description="extra arguments appended to the engine's command")
    env: kubernetes_field(  # type: ignore[valid-type]
        "EnvVar",
        many=True,
        description="extra environment variables of the engine container (core/v1 EnvVar); not the API key "
        "and not the engine switches that are fields here",
        item_rules=(_API_KEY_ENV_RULE, _SWITCH_ENV_RULE),
        max_items=256,
        name_max_length=1024,
    ) = Field(default_factory=list)
    resources: kubernetes_field(  # type: ignore[valid-type]
        "ResourceRequirements",
        description="compute resources of the engine container (core/v1 ResourceRequirements); the "
        "accelerator limit is added from devicesPerNode",
    ) = Field(default_factory=dict)
    api_key_secret: SecretKeyRef | None = Field(
        None,
        description="Secret key given to the engine as its API key (DLO_API_KEY for dlo, VLLM_API_KEY for "
        "vllm-omni); clients send Authorization: Bearer KEY",
    )
    api_keys: ApiKeys | None = Field(
        None,
        description="dlo: named API keys from a Secret, one tenant each (instead of apiKeySecret): a request is "
        "its key's tenant, sees only its own video jobs (admins: all) and has its own quotas",
    )
    shm_size: str | None = Field(None, description="size of /dev/shm; default 1Gi per rank")
    shutdown_grace_seconds: int = Field(
        25, ge=0, le=3600,
        description="dlo: seconds the requests already accepted may run after SIGTERM (`--shutdown-grace`); "
        "the pod's terminationGracePeriodSeconds is this plus 5",
    )
    pin_memory_lock: bool = Field(
        False, description="grant IPC_LOCK (only when pinning must mlock beyond the memlock limit)"
    )
    # -- dlo's engine switches (dlo.engine.settings; `dlo serve` flags of the same names) --
    gather: Transfer | None = Field(
        None,
        description="allgather over more than one device: how each device rebuilds a block (`--gather`): "
        "collective (the default: an in-place AllGather) or peer (each rank copies the others' shards "
        "with the copy engines, no SM); unset: the engine's default",
    )
    gather_max_ctas: int | None = Field(
        None, ge=1, le=MAX_GATHER_CTAS,
        description="allgather on NCCL: the weight gathers on their own communicator capped at this many CTAs "
        "(`--gather-max-ctas`); unset: NCCL's choice",
    )
    ulysses_exchange: UlyssesExchange | None = Field(
        None,
        description="sp > 1, Wan with Ulysses: how self-attention exchanges (`--ulysses-exchange`): overlap "
        "(the default), lean or diffusers; all give the same bytes",
    )
    register_early: bool | None = Field(
        None,
        description="register the engine models' page cache for DMA while the pipeline builds, so resident "
        "copies and streamed blocks move at DMA speed (`--register-early`; default on)",
    )
    max_device_memory: str | None = Field(
        None, pattern=BYTE_SIZE_PATTERN,
        description="the device budget of each rank (`--max-device-memory`: bytes, or 24GiB / 24GB): the engine's "
        "allocator is capped at it, and spec.mode auto and the engine plan with it; unset: the device's memory",
    )
    stream_dtype: StreamDtype | None = Field(
        None, description="how the transformers' streamed blocks are held and copied (`--stream-dtype`): bfloat16, "
        "or fp8 (linear weights float8 e4m3 with a scale per output row, dequantized on the device: half the "
        "bytes; a `dlo quantize` folder streams from the page cache, a bfloat16 one is converted at load); "
        "unset: bfloat16",
    )

    cache: StepCacheSpec | None = Field(
        None, description="the step cache of a request that names none (`--cache`): one of diffusers' cache hooks "
        "by preset, with its parameters; a request's `cache` overrides it; unset: none",
    )

    @field_validator("max_device_memory")
    @classmethod
    def _a_byte_count(cls, value: str | None) -> str | None:
        if value is not None:
            _byte_count(value)
        return value

    def device_budget_bytes(self) -> int | None:
        """`max_device_memory` in bytes (None: unset)."""
        return None if self.max_device_memory is None else _byte_count(self.max_device_memory)

    @model_validator(mode="after")
    def _api_key_only_from_a_secret(self) -> EngineSpec:
        if any(e.get("name") in (API_KEY_ENV, VLLM_API_KEY_ENV) for e in self.env):
            raise ValueError(_API_KEY_ENV_RULE[1])
        if any(e.get("name") in ENGINE_SWITCH_ENV for e in self.env):
            raise ValueError(_SWITCH_ENV_RULE[1])
        return self

    @model_validator(mode="after")
    def _one_source_of_keys(self) -> EngineSpec:
        broken = [rule[1] for rule, bad in ((_ONE_KEY_SOURCE_RULE, self.api_key_secret is not None),
                                            (_API_KEYS_ENGINE_RULE, self.kind != "dlo")) if bad]
        if self.api_keys is not None and broken:
            raise ValueError("; ".join(broken))
        return self

    @model_validator(mode="after")
    def _switches_fit_the_engine(self) -> EngineSpec:
        if self.kind != "dlo" and self.engine_switches():
            raise ValueError(_DLO_SWITCHES_RULE[1])
        if self.gather_max_ctas is not None and self.device not in ("auto", "cuda"):
            raise ValueError(_CTAS_DEVICE_RULE[1])
        if self.max_device_memory is not None and self.device == "cpu":
            raise ValueError(_BUDGET_DEVICE_RULE[1])
        return self

    def engine_switches(self) -> list[str]:
        """The `dlo serve` flags of the switches this spec sets (none for the unset ones)."""
        out: list[str] = []
        if self.gather is not None:
            out += ["--gather", self.gather]
        if self.gather_max_ctas is not None:
            out += ["--gather-max-ctas", str(self.gather_max_ctas)]
        if self.ulysses_exchange is not None:
            out += ["--ulysses-exchange", self.ulysses_exchange]
        if self.register_early is not None:
            out += ["--register-early" if self.register_early else "--no-register-early"]
        if self.max_device_memory is not None:
            out += ["--max-device-memory", self.max_device_memory]
        if self.stream_dtype is not None:
            out += ["--stream-dtype", self.stream_dtype]
        if self.cache is not None:
            out += ["--cache", self.cache.serve_value()]
        return out

    @model_validator(mode="after")
    def _no_args_vllm_omni_refuses(self) -> EngineSpec:
        # Only the operator checks this (args are free strings in the CRD): the pods would exit at
        # start with vllm-omni's own error, crash-looping.
        if self.kind == "vllm-omni":
            refused = sorted({a.split("=", 1)[0] for a in self.args} & set(VLLM_OMNI_REFUSED_FLAGS))
            if refused:
                raise ValueError(
                    f"engine.args: vllm-omni refuses {', '.join(refused)} under --omni; the operator sets the "
                    "ranks per node from devicesPerNode (--num-gpus)"
                )
        return self
