"""Test-only fault injection for `dlo serve`: make one request fail in one phase on one rank.

TEST-ONLY: off in production. Nothing here does anything unless BOTH are set in the server's
environment:

    DLO_TEST_HOOKS=1
    DLO_TEST_FAULTS=phase:rank[:prompt-match][,phase:rank[:prompt-match]...]

`phase` is one of `PHASES`; `rank` is a rank number or `*` (any rank); a fault fires only for a
request whose prompt contains `prompt-match` (every request when it is omitted). The reliability
tests use it to prove that a failure in one phase of one request fails that request alone
(`tests/reliability/test_request_faults.py`).

The seam: nothing of this lives in the request path. A process that runs the plan installs it
from outside the modules it fails: `dlo serve` adds `HttpFaults` (the `validation` phase: a request
fails while it is read, before it is queued) to its app only when `install_http_faults` finds a
plan; a rank wraps its `ServingPipeline`'s phases with `install_rank_faults` (called once by
`rank_main.init_rank`, a no-op without a plan). Production never installs either.

Owns: `FaultPlan` (the parsed variable), `InjectedFault` (what a fired fault raises), `PHASES`, the
HTTP seam (`HttpFaults`, `install_http_faults`) and the rank seam (`RankFaults`,
`install_rank_faults`).
Must never: be enabled by `DLO_TEST_FAULTS` alone, import torch or a web framework, or cost anything
when disabled (`FaultPlan.from_env` returns None and nothing is installed).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)

HOOKS_ENV = "DLO_TEST_HOOKS"
FAULTS_ENV = "DLO_TEST_FAULTS"

# Request phases, in the order a request meets them. All but `forward` are outside the collective
# schedule (the request fails alone); `forward` raises inside a transformer block, between gathers:
# the prefetcher's order can no longer be trusted and the engine restarts.
PHASES = ("validation", "encode", "setup", "step", "forward", "decode", "png", "mp4")


class InjectedFault(RuntimeError):
    """A fault injected by `DLO_TEST_FAULTS` (tests only)."""


@dataclass(frozen=True)
class Fault:
    phase: str
    rank: int | None  # None: any rank
    match: str = ""


@dataclass(frozen=True)
class FaultPlan:
    faults: tuple[Fault, ...]

    @classmethod
    def parse(cls, text: str) -> "FaultPlan":
        faults = []
        for item in filter(None, (s.strip() for s in text.split(","))):
            parts = item.split(":", 2)
            if len(parts) < 2 or parts[0] not in PHASES:
                raise ValueError(f"{FAULTS_ENV}: {item!r} is not phase:rank[:prompt-match] "
                                 f"with phase one of {', '.join(PHASES)}")
            rank = None if parts[1] == "*" else int(parts[1])
            faults.append(Fault(parts[0], rank, parts[2] if len(parts) == 3 else ""))
        return cls(tuple(faults))

    @classmethod
    def from_env(cls, environ: "os._Environ[str] | dict[str, str] | None" = None) -> "FaultPlan | None":
        """The plan, or None (the production case) unless `DLO_TEST_HOOKS=1` and `DLO_TEST_FAULTS` are set."""
        env = os.environ if environ is None else environ
        if env.get(HOOKS_ENV) != "1" or not env.get(FAULTS_ENV):
            return None
        return cls.parse(env[FAULTS_ENV])

    def check(self, phase: str, rank: int, prompt: str) -> None:
        """Raise `InjectedFault` when a fault matches this phase, rank and prompt."""
        for f in self.faults:
            if f.phase == phase and (f.rank is None or f.rank == rank) and f.match in prompt:
                raise InjectedFault(f"injected fault: phase={phase} rank={rank}")


class HttpFaults:
    """ASGI middleware (test-only): a POST whose body contains a `validation` fault's match raises
    `InjectedFault` before the app reads it, as a bug in reading a request would (the server's own
    error handling answers it). Other requests pass through untouched."""

    def __init__(self, app: Any, plan: FaultPlan):
        self.app, self.plan = app, plan

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        messages, more = [], True
        while more:
            message = await receive()
            messages.append(message)
            more = message.get("type") == "http.request" and message.get("more_body", False)
        self.plan.check("validation", 0, b"".join(m.get("body", b"") for m in messages).decode("utf-8", "replace"))

        async def replay() -> dict:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)


def install_http_faults(app: Any, environ: "os._Environ[str] | dict[str, str] | None" = None) -> FaultPlan | None:
    """Add `HttpFaults` to a Starlette app when the environment holds a plan (tests); else nothing."""
    plan = FaultPlan.from_env(environ)
    if plan is not None:
        log.warning("TEST-ONLY fault injection is on: %s", plan)
        app.add_middleware(HttpFaults, plan=plan)
    return plan


class RankFaults:
    """Test-only: `plan`'s faults of this rank, wrapped around a `ServingPipeline`'s phases from the
    outside (its own code holds no check): `encode` the pipeline's prompt encoding, `setup` the
    scheduler's timesteps, `step` each scheduler step (after the step's transformer calls),
    `forward` the pre-hook of the middle block of the first transformer (between offloaded blocks),
    `decode` the VAE, `png`/`mp4` the output's encoding. A fault fires for a request whose prompt
    holds its match."""

    def __init__(self, plan: FaultPlan, rank: int):
        self.plan, self.rank = plan, rank
        self.prompt = ""  # of the request the pipeline runs

    def install(self, pipe: Any) -> None:
        inner = pipe.pipe

        def remember_prompt(gen: Any) -> None:
            self.prompt = gen.prompt

        _wrap(pipe, "run", remember_prompt)
        _wrap(inner, "encode_prompt", self._phase("encode"))
        _wrap(inner.scheduler, "set_timesteps", self._phase("setup"))
        _wrap(inner.scheduler, "step", self._phase("step"))
        _wrap(inner.vae, "decode", self._phase("decode"))
        _wrap(pipe, "encode_output", lambda decoded, *_: self.check("mp4" if decoded.video is not None else "png"))
        blocks = pipe.blocks(pipe.facts.transformers[0])
        pipe.hooks.add_pre(blocks[len(blocks) // 2], lambda *_: self.check("forward"))

    def check(self, phase: str) -> None:
        self.plan.check(phase, self.rank, self.prompt)

    def _phase(self, phase: str) -> Callable[..., None]:
        return lambda *_, **__: self.check(phase)


def _wrap(obj: Any, name: str, before: Callable[..., None]) -> None:
    """`obj.name(...)` calls `before(...)` with the same arguments first (an instance attribute);
    nothing where `obj` has no such method (Cosmos3's pipeline tokenizes inside its call)."""
    real = getattr(obj, name, None)
    if real is None:
        return

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before(*args, **kwargs)
        return real(*args, **kwargs)

    setattr(obj, name, wrapper)


def install_rank_faults(pipe: Any, rank: int,
                        environ: "os._Environ[str] | dict[str, str] | None" = None) -> FaultPlan | None:
    """Wrap `pipe`'s phases with this rank's faults when the environment holds a plan (tests); else
    nothing (production). Returns the plan installed, or None."""
    plan = FaultPlan.from_env(environ)
    if plan is not None:
        log.warning("rank %d: TEST-ONLY fault injection is on: %s", rank, plan)
        RankFaults(plan, rank).install(pipe)
    return plan
