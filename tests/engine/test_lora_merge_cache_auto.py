"""`--lora-merge-cache auto` (the default): sized by `dlo serve`'s plan from what the device budget
has spare, and with a merge cache `--lora-apply auto` merges every request, whatever the cache got
(so a request's bytes do not depend on the mode, whose spares differ)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from dlo.plan.memory_plan import margin_bytes
from dlo.plan.budget import deployment_memory
from dlo.plan.deployment import LoraAsk, auto_merge_cache
from dlo.plan.limits import SMALL
from dlo.plan.memory_plan import resident_plan
from dlo.serving.options import add_arguments, serve_config
from dlo.engine.settings import (
    LORA_MERGE_ABOVE_TOKENS,
    ConfigError,
    EngineSettings,
    LoraSettings,
    OffloadSettings,
)
from tests.engine.test_family_pipelines import preset_pipeline

GB = 10**9


def test_the_settings_merge_every_call_with_a_cache_and_above_the_crossover_without():
    assert LoraSettings("/l").merge_above == LORA_MERGE_ABOVE_TOKENS  # an unsized auto cache: none
    assert LoraSettings("/l").cache_capacity == 0
    assert LoraSettings("/l", merge_cache_bytes=0).merge_above == LORA_MERGE_ABOVE_TOKENS
    assert LoraSettings("/l", merge_cache_bytes=GB).merge_above == 0
    assert LoraSettings("/l", merge_cache_bytes=GB, merge_above_tokens=5).merge_above == 5  # given: kept
    assert LoraSettings("/l", apply="merge").merge_above == -1
    with pytest.raises(ConfigError, match="merge_cache_bytes"):
        LoraSettings("/l", merge_cache_bytes="some")
    with pytest.raises(ConfigError, match="needs lora apply"):
        LoraSettings("/l", apply="branch", merge_cache_bytes=GB)
    assert LoraSettings("/l", apply="branch").merge_cache_bytes == "auto"  # nothing to keep: no refusal
    settings = EngineSettings(OffloadSettings("resident"), lora=LoraSettings("/l"))
    assert EngineSettings.from_dict(settings.to_dict()) == settings


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["/m", *argv])


def lora_settings(args: argparse.Namespace) -> LoraSettings:
    return serve_config(args).lora


def test_the_flag_takes_auto_zero_or_a_byte_count():
    assert lora_settings(_args()).merge_cache_bytes == "auto"
    assert lora_settings(_args("--lora-merge-cache", "0")).merge_cache_bytes == 0
    assert lora_settings(_args("--lora-merge-cache", "2GiB")).merge_cache_bytes == 2 * 2**30
    with pytest.raises(SystemExit):
        _args("--lora-merge-cache", "lots")


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    return deployment_memory(preset_pipeline(tmp_path_factory, "tiny-wan2.1-t2v"), SMALL)


def _fixed(memory, mode: str) -> int:
    request = memory.rank(mode).request_bytes
    return request + margin_bytes(request)


def _plan(memory, budget, mode="resident", blocks=0, merges=10 * GB, **lora):
    """The settings the plan's steps give (`dlo.plan.deployment`: resident blocks, then the cache)."""
    given = LoraSettings("/loras", **lora)
    settings = EngineSettings(OffloadSettings(mode, resident_blocks=blocks), stream_encoders=True, lora=given)
    resident = (resident_plan(memory, mode, 1, budget)[0]
                if blocks == "auto" and mode != "resident" and budget is not None else None)
    if given.merge_cache_bytes != "auto":
        return settings, []
    kept = dict(resident.blocks) if resident else {n: blocks for n in memory.transformers} if mode != "resident" else {}
    ask = LoraAsk(merges_bytes=merges, apply=given.apply, merge_cache="auto",
                  merge_above_tokens=given.merge_above_tokens, served=True)
    size, above, line = auto_merge_cache(ask, memory, mode, 1, budget, kept, resident)
    lora = dataclasses.replace(given, merge_cache_bytes=size,
                               merge_above_tokens=given.merge_above_tokens if above is None else above)
    return dataclasses.replace(settings, lora=lora, resident_plan=resident), [line]


def test_an_auto_cache_gets_the_spare_of_the_mode_up_to_every_merge(memory):
    resident = memory.rank("resident").weights_bytes + _fixed(memory, "resident")
    settings, lines = _plan(memory, resident + 3 * GB)
    assert settings.lora.merge_cache_bytes == 3 * GB and settings.lora.merge_above == 0
    assert "lora merge cache auto: 3.0 GB per rank" in lines[-1] and "more than 0 tokens" in lines[-1]
    settings, _ = _plan(memory, resident + 3 * GB, merges=GB)  # no larger than every adapter's merges
    assert settings.lora.merge_cache_bytes == GB
    settings, _ = _plan(memory, resident - GB)  # no spare: still merged every call, nothing kept
    assert settings.lora.merge_cache_bytes == 0 and settings.lora.merge_above == 0
    # --resident-blocks auto fills the budget first: the cache gets the plan's spare
    lean = memory.rank("rank-local").weights_bytes + _fixed(memory, "rank-local")
    settings, _ = _plan(memory, lean + 2 * GB, mode="rank-local", blocks="auto")
    assert settings.resident_plan is not None
    assert settings.lora.merge_cache_bytes == settings.resident_plan.spare_bytes < 2 * GB
    # an explicit count of resident blocks: the rest of the budget
    settings, _ = _plan(memory, lean + 2 * GB, mode="rank-local", blocks=0)
    assert settings.lora.merge_cache_bytes == 2 * GB


def test_without_a_budget_branch_or_a_given_size_nothing_is_sized(memory):
    settings, lines = _plan(memory, None)  # cpu
    assert settings.lora.merge_cache_bytes == 0 and settings.lora.merge_above == LORA_MERGE_ABOVE_TOKENS
    assert lines[-1] == "lora merge cache auto: none (no device budget (cpu))"
    settings, _ = _plan(memory, 500 * GB, apply="branch")
    assert settings.lora.cache_capacity == 0
    settings, lines = _plan(memory, 500 * GB, merge_cache_bytes=0)
    assert settings.lora.merge_cache_bytes == 0 and settings.lora.merge_above == LORA_MERGE_ABOVE_TOKENS
    assert not any("merge cache" in line for line in lines)
    given = dataclasses.replace(LoraSettings("/loras", merge_cache_bytes=GB))
    settings, _ = _plan(memory, 500 * GB, merge_cache_bytes=GB)
    assert settings.lora == given
