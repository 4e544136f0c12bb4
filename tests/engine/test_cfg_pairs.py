"""CFG pairs ([Note: CFG pairs] in `dlo.engine.cfg_pairs`): a step's cond and uncond calls walk the
streamed blocks together. With a recording stand-in prefetcher: the turns the lanes take, one gather a
block a paired step, the stash handed out only for the inputs predicted, a lane that raises ending the
call without a thread left. Through the served tiny Wan2.1 pipeline (rank-local, cpu): the same bytes
as unpaired, with and without a LoRA adapter merged per call, for half the gathers."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from dlo.engine.cfg_pairs import CfgPairs, ModelPairs, Turns, pairs_unavailable, same_inputs
from dlo.engine.hooks import HookSet, attach_prefetcher


class Recorder:
    """A prefetcher's schedule, recorded: which block each lane bound, gathered and freed."""

    def __init__(self, blocks: list[nn.Module]):
        self.blocks = [type("Blk", (), {"module": b})() for b in blocks]
        self.lane: int | None = None
        self.events: list[tuple[str, int | None, int | None]] = []
        self._running: int | None = None

    def before_block(self, i: int) -> None:
        self.events.append(("bind", i, self.lane))
        self._running = i

    def after_block(self) -> None:
        self.events.append(("free", self._running, self.lane))


class Toy(nn.Module):
    """A transformer's shape: an embedding, blocks, an output layer; text enters every block."""

    def __init__(self, n: int = 3):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(n))
        self.out = nn.Linear(4, 4)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g)

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False):
        h = self.embed(hidden_states) + timestep
        for b in self.blocks:
            h = torch.tanh(b(h) + encoder_hidden_states)
        return (self.out(h),)


def _paired_toy(n: int = 3):
    toy = Toy(n)
    rec = Recorder(list(toy.blocks))
    hooks = HookSet()
    attach_prefetcher(rec, hooks)
    return toy, rec, CfgPairs(toy, rec, torch.device("cpu"))


def _closed_leaves_no_thread(pairs: CfgPairs) -> None:
    thread = pairs._thread._thread
    pairs.close()
    assert thread is None or not thread.is_alive()


def _steps(model, steps: int, cond, uncond, *, other_uncond=None, fresh_timestep=False, other_t_at=None):
    """A CFG loop as WanPipeline runs it: the same latents and timestep objects to both calls; with
    `fresh_timestep` as QwenImagePipeline does, `t / 1000` made anew for each call (at step
    `other_t_at` the uncond call's of another value)."""
    x = torch.ones(2, 4)
    for i in range(steps):
        t = torch.full((1,), float(i))
        t_c = t / 1000 if fresh_timestep else t
        c = model(hidden_states=x, timestep=t_c, encoder_hidden_states=cond, return_dict=False)[0]
        neg = other_uncond if other_uncond is not None and i == steps - 1 else uncond
        t_u = (t + (i == other_t_at)) / 1000 if fresh_timestep else t
        u = model(hidden_states=x, timestep=t_u, encoder_hidden_states=neg, return_dict=False)[0]
        x = x - 0.1 * (u + 5.0 * (c - u))
    return x


def test_paired_steps_give_the_unpaired_bytes_for_one_gather_a_block_a_step():
    cond, uncond = torch.randn(4), torch.randn(4)
    toy, rec, pairs = _paired_toy()
    want = _steps(toy, 3, cond, uncond)  # no request: unpaired
    unpaired = list(rec.events)
    assert [e[0] for e in unpaired].count("bind") == 3 * 2 * 3
    rec.events.clear()
    lane_threads = set()
    toy.blocks[0].register_forward_pre_hook(
        lambda *_: lane_threads.add(threading.get_ident()) if threading.current_thread().name == "dlo-cfg-uncond"
        else None)
    with pairs.request(cfg=True):
        got = _steps(toy, 3, cond, uncond)
    assert torch.equal(got, want)
    assert pairs.pairs == 2 and pairs.misses == 0  # the first step teaches, the two after it pair
    binds = [e for e in rec.events if e[0] == "bind"]
    assert len(binds) == 3 * (2 + 1 + 1)
    # a paired walk: lane 0 binds (and gathers the next), lane 1 runs that block and frees it
    paired = rec.events[-6:]
    assert paired == [("bind", 0, 0), ("free", 0, 1), ("bind", 1, 0), ("free", 1, 1), ("bind", 2, 0), ("free", 2, 1)]
    assert rec.lane is None and len(lane_threads) == 1  # one uncond thread for every step (cuDNN's plans)
    _closed_leaves_no_thread(pairs)


def test_an_uncond_call_with_other_inputs_than_predicted_runs_itself_and_ends_pairing():
    cond, uncond, other = torch.randn(4), torch.randn(4), torch.randn(4)
    toy, _rec, pairs = _paired_toy()
    want = _steps(toy, 4, cond, uncond, other_uncond=other)
    with pairs.request(cfg=True):
        got = _steps(toy, 4, cond, uncond, other_uncond=other)
    assert torch.equal(got, want)  # the stash made from `uncond` was not handed out for `other`
    assert pairs.pairs == 2 and pairs.misses == 1
    _closed_leaves_no_thread(pairs)


def test_the_waiting_lane_thread_holds_nothing_of_the_last_request():
    """Between requests the uncond thread waits for its next job: it must not keep the last one's
    call (its inputs and output, the transformer and through it the mapped weights) alive."""
    import gc
    import weakref

    cond, uncond = torch.randn(4), torch.randn(4)
    toy, _rec, pairs = _paired_toy()
    with pairs.request(cfg=True):
        _steps(toy, 3, cond, uncond)
    thread, gone = pairs._thread._thread, weakref.ref(toy)
    assert thread.is_alive()
    del toy, _rec, pairs  # never closed: a pipeline a failed test left behind
    gc.collect()
    assert gone() is None


def test_a_timestep_made_anew_for_each_call_is_checked_by_value():
    """QwenImagePipeline passes `timestep / 1000`, a new tensor a call: the uncond lane takes the
    cond call's, and each uncond call's is compared by value: equal, the stash; other, a miss."""
    cond, uncond = torch.randn(4), torch.randn(4)
    toy, _rec, pairs = _paired_toy()
    want = _steps(toy, 4, cond, uncond, fresh_timestep=True)
    with pairs.request(cfg=True):
        got = _steps(toy, 4, cond, uncond, fresh_timestep=True)
        assert pairs._by_value == {"timestep"} and set(pairs._uncond) == {"encoder_hidden_states"}
    assert torch.equal(got, want) and pairs.pairs == 3 and pairs.misses == 0
    want = _steps(toy, 4, cond, uncond, fresh_timestep=True, other_t_at=2)
    with pairs.request(cfg=True):
        got = _steps(toy, 4, cond, uncond, fresh_timestep=True, other_t_at=2)
    assert torch.equal(got, want)  # the stash made with the cond call's timestep was not handed out
    assert pairs.pairs == 3 + 1 and pairs.misses == 1  # (counted over the pairs' life) step 1 paired, 2 missed
    _closed_leaves_no_thread(pairs)


def test_a_request_without_cfg_and_after_close_runs_as_diffusers_built_it():
    toy, rec, pairs = _paired_toy()
    x, t, c = torch.ones(2, 4), torch.zeros(1), torch.randn(4)
    with pairs.request(cfg=False):
        for _ in range(3):
            toy(hidden_states=x, timestep=t, encoder_hidden_states=c)
    assert pairs.pairs == 0 and {e[2] for e in rec.events} == {None}
    pairs.close()
    assert "forward" not in toy.__dict__  # the class's forward again
    assert all(len(b._forward_hooks) == 1 for b in toy.blocks)  # the prefetcher's own post-hook, no pairs


@pytest.mark.parametrize("lane", [0, 1])
def test_a_lane_that_raises_fails_the_call_and_leaves_no_state(lane):
    cond, uncond = torch.randn(4), torch.randn(4)
    toy, rec, pairs = _paired_toy()

    def boom(_m, args):
        if (threading.current_thread().name == "dlo-cfg-uncond") == (lane == 1) and pairs._turns is not None:
            raise RuntimeError(f"lane {lane} failed")

    toy.blocks[1].register_forward_pre_hook(boom)
    t0 = time.monotonic()
    with pairs.request(cfg=True), pytest.raises(RuntimeError, match=f"lane {lane} failed"):
        _steps(toy, 3, cond, uncond)
    assert time.monotonic() - t0 < 5  # no lane waited for a turn that never came
    assert pairs._turns is None and rec.lane is None
    _closed_leaves_no_thread(pairs)


def test_turns_alternate_and_a_finished_lane_hands_nothing():
    turns, order = Turns(), []

    def lane_one():
        turns.wait(1)
        for i in range(3):
            order.append((1, i))
            turns.hand(1)
        turns.end(1)

    th = threading.Thread(target=lane_one)
    th.start()
    for i in range(3):
        order.append((0, i))
        turns.hand(0)
    turns.hand(0)  # lane 1 ended: nothing to wait for
    turns.end(0)
    th.join(5)
    assert order == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)] and not th.is_alive()


def test_inputs_are_the_objects_predicted_or_equal_plain_values():
    a, b = torch.ones(2), torch.ones(2)
    assert same_inputs((a,), {"x": None, "d": False, "s": 1.5}, (a,), {"x": None, "d": False, "s": 1.5})
    assert not same_inputs((a,), {}, (b,), {})  # equal values, another tensor: not predicted
    assert not same_inputs((), {"d": 1}, (), {"d": True})  # 1 == True, but not the same argument
    assert not same_inputs((), {"x": a}, (), {"y": a})
    # learned by value: the values, dtype, shape and strides must match, not the object
    assert same_inputs((), {"t": a}, (), {"t": b}, frozenset({"t"}))
    assert not same_inputs((), {"t": a}, (), {"t": b + 1}, frozenset({"t"}))
    assert not same_inputs((), {"t": a}, (), {"t": b.double()}, frozenset({"t"}))
    m = torch.arange(4.0).reshape(2, 2)
    assert not same_inputs((), {"t": m.t().contiguous()}, (), {"t": m.t()}, frozenset({"t"}))  # other strides
    assert not same_inputs((), {"t": torch.zeros(1)}, (), {"t": -torch.zeros(1)}, frozenset({"t"}))  # -0 is not 0
    assert not same_inputs((), {"t": torch.ones(3)[1:]}, (), {"t": torch.ones(2)}, frozenset({"t"}))  # offset


def test_only_a_streamed_rank_local_deployment_of_a_pairing_family_pairs():
    assert pairs_unavailable("rank-local", 1, "cuda", True, True) is None
    assert "rank-local" in pairs_unavailable("allgather", 1, "cuda", True, True)
    assert "sp" in pairs_unavailable("rank-local", 2, "cuda", True, True)
    assert "family" in pairs_unavailable("rank-local", 1, "cuda", False, True)
    assert "streams" in pairs_unavailable("rank-local", 1, "cpu", True, False)
    assert "npu" in pairs_unavailable("rank-local", 1, "npu", True, True)


def _paired_request(tmp_path_factory, family: str, lora: str | None):
    """(pipeline folder, max_sequence_length, request) of a family's tiny pipeline with CFG."""
    import dataclasses

    from dlo.engine.request import Generation
    from tests.engine.lora_helpers import SEQ
    from tests.engine.serving_helpers import tiny_pipeline
    from tests.engine.test_family_pipelines import png, preset_pipeline

    video = Generation(kind="video", prompt="a lighthouse", negative_prompt="blur", seed=5, width=32, height=32,
                       steps=3, guidance_scale=5.0, frames=5, fps=2, lora_id="style" if lora else None)
    if family == "wan":
        return tiny_pipeline(tmp_path_factory, "wan"), SEQ, video
    if family == "wan-i2v":  # its calls add the image's embeddings (the same object to both)
        return preset_pipeline(tmp_path_factory, "tiny-wan2.1-i2v"), SEQ, dataclasses.replace(video, image=png())
    if family == "wan2.2":  # two experts: each pairs its own steps (4 steps reach both)
        return preset_pipeline(tmp_path_factory, "tiny-wan2.2-t2v-a14b"), SEQ, dataclasses.replace(video, steps=4)
    # Qwen-Image: its template fills the first 32 tokens of the tiny tokenizer's: the prompts differ only beyond
    return preset_pipeline(tmp_path_factory, "tiny-qwen-image"), 512, dataclasses.replace(
        video, kind="image", frames=1, fps=0, guidance_scale=4.0)


@pytest.mark.slow
@pytest.mark.parametrize("family, lora", [("wan", None), ("wan", "merge"), ("wan", "branch"), ("wan-i2v", None),
                                          ("wan2.2", None), ("qwen-image", None), ("qwen-image", "merge")])
def test_a_served_request_paired_gives_the_unpaired_bytes_for_fewer_gathers(tmp_path_factory, family, lora):
    from dlo.engine.random_lora import write_adapter
    from dlo.serving.pipeline import ServingPipeline
    from dlo.engine.settings import EngineSettings, LoraSettings, OffloadSettings

    model, seq, gen = _paired_request(tmp_path_factory, family, lora)
    settings = LoraSettings()
    if lora is not None:  # merged per call on the streamed layers, or the branch: either, twice a step unpaired
        adapters = tmp_path_factory.mktemp("pairs-lora")
        write_adapter(model, adapters / "style", rank=4, alpha=2.0, seed=1)
        settings = LoraSettings(str(adapters), apply=lora)
    out, gathers = {}, {}
    for pairs in (False, True):
        pipe = ServingPipeline(model, EngineSettings(OffloadSettings("rank-local"), lora=settings, cfg_pairs=pairs),
                               max_sequence_length=seq)
        try:
            assert isinstance(pipe.pairs, ModelPairs) == pairs
            steps = {name: calls // 2 for name, calls in pipe.call_plan(gen) if calls}  # each transformer's
            learned = []
            if pairs:  # what each transformer's first step taught: the negative prompt's embeddings by object
                assert len(pipe.pairs.each) == len(pipe.facts.transformers)
                for one in pipe.pairs.each:
                    learn = one._learn
                    one._learn = lambda a, k, one=one, learn=learn: (
                        learn(a, k), learned.append((set(one._uncond), set(one._by_value))))
            before = {name: pipe.models[name].stats().gathers for name in steps}
            out[pairs] = pipe.run(gen).outputs[0]
            gathers[pairs] = {name: pipe.models[name].stats().gathers - before[name] for name in steps}
            if pairs:
                assert pipe.pairs.pairs == gen.steps - len(steps) and pipe.pairs.misses == 0
                by_value = {"timestep"} if family == "qwen-image" else set()
                assert learned == [({"encoder_hidden_states"}, by_value)] * len(steps)
            kept = pipe.lora.block_merges
            assert (kept is not None) == (pairs and lora == "merge")
            if kept is not None:  # every paired step's uncond lane took the cond lane's merges, none made
                assert kept.taken == (gen.steps - 1) * len(kept.position) > 0 and pipe.lora.ahead is None
        finally:
            pipe.close()
    assert out[True] == out[False]
    for name, n in steps.items():  # each transformer's first step: two walks, then one a step
        blocks = gathers[False][name] // (2 * n)
        assert blocks > 0 and gathers[True][name] == blocks * (n + 1)


def test_the_flag_reaches_the_engine_settings_and_the_ranks():
    from dlo.engine.settings import EngineSettings
    from tests.engine.serving_helpers import serve_settings

    on = serve_settings([], "rank-local")
    off = serve_settings(["--no-cfg-pairs"], "rank-local")
    assert on.cfg_pairs and not off.cfg_pairs  # on by default (measured: record `lora-h200-2026-12-06-pairs`)
    assert EngineSettings.from_dict(on.to_dict()).cfg_pairs  # what every rank is started with
    assert not EngineSettings.from_dict(off.to_dict()).cfg_pairs


def test_a_block_s_merge_is_handed_out_only_for_its_layer_and_bound_weight():
    from dlo.engine.lora.block_merges import BlockMerges
    from dlo.engine.lora.weights import Branch

    layers = [nn.Linear(4, 3, bias=False) for _ in range(4)]  # two blocks of two adapted layers
    b = {m: Branch(torch.ones(2, 4), torch.ones(3, 2), None, 1.0) for m in layers}
    kept = BlockMerges({m: i // 2 for i, m in enumerate(layers)}, {"a": b}, torch.device("cpu"))
    assert [kept.position[m] for m in layers] == [0, 1, 0, 1] and len(kept.buffers) == 2
    w = layers[0].weight
    merged = (kept.views_for(layers[0], b[layers[0]], w, None)[0], None)
    kept.keep(layers[0], w, None, merged)
    assert kept.take(layers[0], w, None) is merged
    assert kept.take(layers[0], w.detach().clone(), None) is None  # another weight: not its merge
    kept.keep(layers[2], layers[2].weight, None, merged)  # the next block's layer at that position
    assert kept.take(layers[0], w, None) is None and kept.take(layers[2], layers[2].weight, None) is merged
    kept.forget()
    assert kept.take(layers[2], layers[2].weight, None) is None and kept.taken == 2


def test_a_lane_thread_that_cannot_start_fails_one_call_and_leaves_the_next_request_whole():
    cond, uncond = torch.randn(4), torch.randn(4)
    toy, rec, pairs = _paired_toy()
    want = _steps(toy, 3, cond, uncond)
    submit = pairs._thread.submit

    def no_thread(fn):
        raise RuntimeError("can't start new thread")

    pairs._thread.submit = no_thread
    with pairs.request(cfg=True), pytest.raises(RuntimeError, match="can't start new thread"):
        _steps(toy, 3, cond, uncond)
    assert pairs._turns is None and rec.lane is None  # no turn left for a lane that never ran
    pairs._thread.submit = submit
    t0 = time.monotonic()
    with pairs.request(cfg=True):
        assert torch.equal(_steps(toy, 3, cond, uncond), want)
    assert time.monotonic() - t0 < 5 and pairs.pairs == 2
    _closed_leaves_no_thread(pairs)


def test_dlo_serve_counts_a_block_s_kept_merges_in_the_budget_only_with_pairs(tmp_path_factory):
    import argparse

    from dlo.engine.families import pipeline_facts
    from dlo.engine.random_lora import write_adapter
    from dlo.serving.serve import _Start, _adapters
    from dlo.serving.options import add_arguments, serve_config
    from dlo.engine.timing import Laps
    from tests.engine.serving_helpers import tiny_pipeline

    model = tiny_pipeline(tmp_path_factory, "wan")
    adapters = tmp_path_factory.mktemp("budget-lora")
    write_adapter(model, adapters / "style", rank=4, alpha=2.0, seed=1)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    held = {}
    for pairs, more in ((False, ()), (True, ()), ("sp 2", ("--sp", "2"))):
        args = parser.parse_args([str(model), "--lora-dir", str(adapters), "--lora-apply", "merge",
                                  "--cfg-pairs" if pairs else "--no-cfg-pairs", *more])
        start = _Start(model, Laps(0.0), facts=pipeline_facts(model))
        _adapters(serve_config(args), start)
        held[pairs] = start.adapter_bytes
    assert held[True] > held[False] > 0  # a block's merges in place of the look-ahead's one layer
    assert held["sp 2"] == held[False]  # pairs never run at sp > 1: nothing kept for them
