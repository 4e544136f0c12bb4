"""Test-only fault injection for `dlo serve`: make one request fail in one phase on one rank.

TEST-ONLY: off in production. Nothing here does anything unless BOTH are set in the server's
environment:

    DLO_TEST_HOOKS=1
    DLO_TEST_FAULTS=phase:rank[:prompt-match][,phase:rank[:prompt-match]...]

`phase` is one of `PHASES`; `rank` is a rank number or `*` (any rank); a fault fires only for a
request whose prompt contains `prompt-match` (every request when it is omitted). The reliability
tests use it to prove that a failure in one phase of one request fails that request alone
(`tests/reliability/test_request_faults.py`).

Owns: `FaultPlan` (the parsed variable), `InjectedFault` (what a fired fault raises) and `PHASES`.
Must never: be enabled by `DLO_TEST_FAULTS` alone, import torch, or cost anything when disabled
(`FaultPlan.from_env` returns None and callers skip every check).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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
