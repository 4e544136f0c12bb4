"""CFG pairs: a step's cond and uncond transformer calls walk the streamed blocks together.

Owns: `CfgPairs` (one streamed transformer's pairing: the calls of a request counted, the uncond
call's inputs predicted, the two lanes run in lockstep, the stash), `ModelPairs` (a pipeline's: one
`CfgPairs` on each streamed transformer), `Turns` (whose lane runs),
`pairs_unavailable` (why a deployment cannot pair, or None), `pairing_on` (that, logged) and
`NO_PAIRS` (what a deployment without pairs holds in their place).
Must never: let two lanes run at once (the block hooks, the LoRA bank and the prefetcher keep state
per call), hand out a stashed output for other inputs than it was made from, or leave a lane's
thread behind (a lane that raises ends the other; the call raises).

[Note: CFG pairs] diffusers' `WanPipeline` runs classifier-free guidance as two transformer calls a
step: cond, then uncond, with the same latents and timestep objects and the negative prompt's
embeddings. Streamed, each call gathers every block: twice the host-to-device bytes a step needs,
and with a LoRA adapter merged per call twice the merges (record `lora-merge-overlap-2026-12-06`). With pairs
on, the cond call also runs the uncond call, on a second thread, block by block: the threads take
turns at every streamed block's end (`Turns`: one runs at a time, so every hook sees the calls one
after the other, as without pairs). The cond lane's pre-hook waits for block i's slot, binds it and
gathers block i+1 as always; the uncond lane runs block i from the same bound slot and frees it
(`SlotPrefetcher.lane`). Each lane runs exactly its own call's kernels, so the bytes do not change.
The uncond call's inputs are predicted from the step before: which keyword arguments its uncond call
passed other objects for than its cond call (Wan: `encoder_hidden_states`), and of those which were
new tensors of the cond call's values (Qwen-Image: `timestep / 1000`, made for each call: the uncond
lane takes the cond call's, and the uncond call's is compared by its bytes, dtype, shape, strides
and storage offset: one host sync a step); at the uncond call the stash is returned where every argument is the object
predicted (values compared where plain or so learned), else the call runs as always (a miss: pairs
off for the rest of the request, a warning). The first step runs unpaired: it teaches the prediction.
Not detected: a tensor changed in place between the two calls (inference tensors keep no version
counter; a family is marked `cfg_pairs` only where its pipeline makes no such change: WanPipeline's,
WanImageToVideoPipeline's and QwenImagePipeline's loops checked). The uncond lane runs under the cond
call's diffusers cache context ("cond"): nothing without diffusers' cache hooks, which the engine
does not enable. The warm-up's denoising runs paired too, but at its default one step (unpaired: the
first step teaches) the first paired request's uncond thread makes its cuDNN plans. Memory: the
waiting lane's state between blocks (its hidden states, rotary tables and text states), which the
memory model adds to a rank-local transformer call (`PipelineFamily.paired_lane_bytes`: the lane hands
over in a block's forward hook, so it holds that block's input and output; Wan2.1-14B: 0.18 GB at
832x480x17).

The transformer's `forward` is overridden on the instance (removed by `close`): a forward hook can
change a call's output but cannot skip the call, and the uncond call must not run again. This is the
one exception to `dlo.engine.hooks`' rule.
"""

from __future__ import annotations

import logging
import queue
import threading
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, Iterator

import torch
from torch import nn

from dlo.engine.hooks import HookSet

log = logging.getLogger(__name__)

PLAIN = (bool, int, float, str, bytes, type(None))  # arguments compared by value; others by identity
WAIT_S = 1.0  # a waiting lane rechecks whether the other ended this often


class LaneEnded(RuntimeError):
    """The other lane raised: this one stops where it waits."""


def pairs_unavailable(mode: str, sp: int, device_type: str, family_pairs: bool, streamed: bool) -> str | None:
    """Why a deployment cannot pair its CFG calls ([Note: CFG pairs]); None where it can."""
    if not family_pairs:
        return "the family's pipeline is not known to call cond then uncond with the same inputs"
    if mode != "rank-local":
        return f"mode {mode}: pairs need rank-local (allgather's gathers are collective; resident streams nothing)"
    if sp != 1:
        return "sp > 1: the lanes' exchanges would interleave across ranks"
    if device_type not in ("cpu", "cuda"):
        return f"device {device_type}"
    if not streamed:
        return "no block streams"
    return None


def pairing_on(asked: bool, mode: str, sp: int, device_type: str, family_pairs: bool, streamed: bool) -> bool:
    """Whether `--cfg-pairs` takes on this deployment; where asked, the start log says so or why not."""
    if not asked:
        return False
    why = pairs_unavailable(mode, sp, device_type, family_pairs, streamed)
    if why is not None:
        log.info("cfg pairs off: %s", why)
        return False
    log.info("cfg pairs on: a step's cond and uncond calls walk the streamed blocks together")
    return True


class Turns:
    """Which of two lanes runs; a lane waits for its turn, hands it over, or ends."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.holder = 0
        self.ended = [False, False]
        self.error: BaseException | None = None

    def wait(self, lane: int) -> None:
        with self._cv:
            while self.holder != lane and self.error is None and not self.ended[1 - lane]:
                self._cv.wait(WAIT_S)
            self._raise_if_failed()
            self.holder = lane

    def hand(self, lane: int) -> bool:
        """Lane `lane` hands the turn to the other and waits for it back; False (at once) where the
        other has ended, `LaneEnded` where it raised."""
        with self._cv:
            self._raise_if_failed()
            if self.ended[1 - lane]:
                return False
            self.holder = 1 - lane
            self._cv.notify_all()
        self.wait(lane)
        return True

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise LaneEnded(f"the other lane raised: {type(self.error).__name__}: {self.error}") from self.error

    def end(self, lane: int, error: BaseException | None = None) -> None:
        with self._cv:
            self.ended[lane] = True
            if error is not None and self.error is None:
                self.error = error
            self.holder = 1 - lane
            self._cv.notify_all()


def same_argument(a: Any, b: Any) -> bool:
    """The same object, or for plain values the same type and value."""
    return a is b or (isinstance(a, PLAIN) and type(a) is type(b) and a == b)


def same_tensor_value(a: Any, b: Any) -> bool:
    """Two tensors that compute alike: the same device, dtype, shape, strides, storage offset and
    bytes (`torch.equal` holds -0 equal to 0; on a device, one host sync)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device == b.device
            and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset()):
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def same_inputs(args: tuple, kwargs: dict, want_args: tuple, want_kwargs: dict,
                by_value: frozenset = frozenset()) -> bool:
    """Whether a call's arguments are the objects (plain values: the values) predicted; the keywords
    in `by_value` are tensors compared by value (`same_tensor_value`)."""
    if len(args) != len(want_args) or kwargs.keys() != want_kwargs.keys():
        return False
    same = {k: same_tensor_value if k in by_value else same_argument for k in kwargs}
    return (all(same_argument(a, b) for a, b in zip(args, want_args))
            and all(same[k](kwargs[k], want_kwargs[k]) for k in kwargs))


class LaneThread:
    """The uncond lane's thread, one for the pairs' life: torch keeps cuDNN's execution plans per
    thread, so a fresh thread every step would plan Wan's patch-embedding convolution again every
    step (`dlo.serving.threads.WaveThread` keeps rank 0's waves on one thread for the same reason)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Any) -> threading.Event:
        """Run `fn` (which handles its own errors) on the thread; the event is set once it returned."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="dlo-cfg-uncond", daemon=True)
            self._thread.start()
        done = threading.Event()
        self._jobs.put((fn, done))
        return done

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._run(*job)
            del job  # waiting for the next, the thread holds nothing of this one (its call's tensors, the model)

    @staticmethod
    def _run(fn: Any, done: threading.Event) -> None:
        try:
            fn()
        finally:
            done.set()

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=5)
            self._thread = None


class NoPairs:
    """Where `--cfg-pairs` did not take: every request's calls run as diffusers makes them."""

    def request(self, cfg: bool) -> Any:
        return nullcontext()

    def close(self) -> None:
        pass


NO_PAIRS = NoPairs()


class ModelPairs:
    """CFG pairs on each streamed transformer of a pipeline: Wan2.2's two experts each pair their own
    calls (one `CfgPairs` each, one uncond thread each; the experts run one after the other)."""

    def __init__(self, each: list["CfgPairs"]):
        self.each = each

    @property
    def pairs(self) -> int:
        return sum(p.pairs for p in self.each)

    @property
    def misses(self) -> int:
        return sum(p.misses for p in self.each)

    @contextmanager
    def request(self, cfg: bool) -> Iterator[None]:
        with ExitStack() as stack:
            for p in self.each:
                stack.enter_context(p.request(cfg))
            yield

    def close(self) -> None:
        for p in self.each:
            p.close()


class CfgPairs:
    """A streamed transformer's cond and uncond calls of each step, walked together ([Note: CFG pairs])."""

    def __init__(self, module: nn.Module, prefetcher: Any, device: torch.device):
        self.module, self.prefetcher, self.device = module, prefetcher, device
        self._original = module.forward
        module.forward = self._forward  # the instance's: `close` removes it
        self.hooks = HookSet()
        for blk in prefetcher.blocks:  # after the prefetcher's own post-hook: the slot is freed first
            self.hooks.add_post(blk.module, self._block_done)
        self.pairs = self.misses = 0  # uncond calls answered from the stash, and predictions missed
        self._turns: Turns | None = None
        self._lanes: dict[int, int] = {}  # thread ident -> lane, while a pair runs
        self._thread = LaneThread()
        self._reset(False)

    def _reset(self, cfg: bool) -> None:
        self._cfg, self._calls, self._off = cfg, 0, False
        self._cond: tuple[tuple, dict] | None = None  # the last unpaired cond call's arguments
        self._uncond: dict | None = None  # what the uncond call passes other objects for
        self._by_value: frozenset = frozenset()  # new tensors a call, equal to the cond call's: checked by value
        self._stash: tuple[tuple, dict, Any] | None = None  # the predicted uncond arguments, its output

    @contextmanager
    def request(self, cfg: bool) -> Iterator[None]:
        """The transformer calls inside are one request's; `cfg`: it runs cond and uncond calls."""
        self._reset(cfg)
        try:
            yield
        finally:
            self._reset(False)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self._cfg or self._off:
            return self._original(*args, **kwargs)
        call, self._calls = self._calls, self._calls + 1
        return self._cond_call(args, kwargs) if call % 2 == 0 else self._uncond_call(args, kwargs)

    def _cond_call(self, args: tuple, kwargs: dict) -> Any:
        if self._uncond is None:  # the first step: unpaired, it teaches the prediction
            self._cond = (args, kwargs)
            return self._original(*args, **kwargs)
        want = {**kwargs, **self._uncond}
        out, stashed = self._run_pair(args, kwargs, want)
        self._stash = (args, want, stashed)
        return out

    def _uncond_call(self, args: tuple, kwargs: dict) -> Any:
        stash, self._stash = self._stash, None
        if stash is not None:
            if same_inputs(args, kwargs, stash[0], stash[1], self._by_value):
                self.pairs += 1
                return stash[2]
            self._miss("the uncond call's arguments are not the ones predicted")
            return self._original(*args, **kwargs)
        if self._cond is not None:
            self._learn(args, kwargs)
        return self._original(*args, **kwargs)

    def _learn(self, args: tuple, kwargs: dict) -> None:
        cond_args, cond_kwargs = self._cond
        self._cond = None
        if len(args) != len(cond_args) or any(a is not b for a, b in zip(args, cond_args)) \
                or kwargs.keys() != cond_kwargs.keys():
            self._miss("the uncond call's positional arguments or keys differ from the cond call's")
            return
        other = {k for k, v in kwargs.items() if not same_argument(v, cond_kwargs[k])}
        # a tensor made anew for each call with the cond call's values (QwenImagePipeline's
        # `timestep / 1000`): the uncond lane takes the cond call's, the uncond call is checked by value
        self._by_value = frozenset(k for k in other if same_tensor_value(kwargs[k], cond_kwargs[k]))
        self._uncond = {k: kwargs[k] for k in other - self._by_value}

    def _miss(self, why: str) -> None:
        self.misses += 1
        self._off = True
        log.warning("cfg pairs: %s; the rest of this request runs unpaired", why)

    # ---- the two lanes -------------------------------------------------------------------------
    def _run_pair(self, args: tuple, kwargs: dict, uncond: dict) -> tuple[Any, Any]:
        """The cond call here (lane 0) and the uncond call on a thread (lane 1), taking turns at every
        streamed block's end; both outputs."""
        turns, result = Turns(), {}
        state = self._thread_state()
        done = None
        try:
            self._turns, self._lanes = turns, {threading.get_ident(): 0}
            self.prefetcher.lane = 0
            done = self._thread.submit(lambda: self._lane_one(turns, args, uncond, result, state))
            out = self._original(*args, **kwargs)
        except BaseException as e:
            turns.end(0, e)
            if done is not None:
                done.wait()
            if "error" in result:  # the uncond lane raised first: the cond lane stopped for it
                raise result["error"] from e
            raise
        else:
            turns.end(0)
            done.wait()
        finally:
            self._turns, self._lanes = None, {}
            self.prefetcher.lane = None
        if "error" in result:
            raise result["error"]
        return out, result["out"]

    def _lane_one(self, turns: Turns, args: tuple, kwargs: dict, result: dict, state: tuple) -> None:
        self._lanes[threading.get_ident()] = 1
        error = None
        try:
            with self._entered(state):
                turns.wait(1)
                self.prefetcher.lane = 1
                result["out"] = self._original(*args, **kwargs)
        except LaneEnded:
            pass  # the cond lane raised: its error is the call's
        except BaseException as e:
            result["error"] = error = e
        finally:
            turns.end(1, error)

    def _block_done(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        turns = self._turns
        if turns is None:
            return
        lane = self._lanes[threading.get_ident()]
        if turns.hand(lane):
            self.prefetcher.lane = lane
            return
        # the other lane ended with blocks left to this one (never in lockstep): this lane frees the
        # slot it ran from and runs on unpaired (an order the prefetcher refuses fails the call loudly)
        if lane == 0:
            self.prefetcher.after_block()
        self.prefetcher.lane = None

    def _thread_state(self) -> tuple:
        """What the uncond lane takes of torch's per-thread state for this call: grad and inference
        mode, autocast, and on cuda the device and the prefetcher's compute stream (the stream the
        slots' events order: [Note: stream lifetimes] in `dlo.engine.prefetch`)."""
        kind = self.device.type
        autocast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        stream = self.prefetcher.compute_stream if kind == "cuda" else None
        return torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, stream

    def _entered(self, state: tuple) -> ExitStack:
        grad, inference, autocast, stream = state
        stack = ExitStack()
        stack.enter_context(torch.inference_mode() if inference else torch.set_grad_enabled(grad))
        if autocast is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=autocast))
        if stream is not None:
            stack.enter_context(torch.cuda.device(self.device))
            stack.enter_context(torch.cuda.stream(stream))
        return stack

    def close(self) -> None:
        self._thread.close()
        self.hooks.remove()
        if self.module.__dict__.get("forward") == self._forward:
            del self.module.forward
