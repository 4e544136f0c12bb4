"""Candidate limits (`dlo.plan.limits_fit`): the first that passes a check found by halving."""

from __future__ import annotations


def test_the_first_passing_limits_are_found_by_halving_with_the_linear_answer():
    """`largest_passing`: over candidates that each ask no more than the one before, the first that
    passes a check is the one a scan finds, in about log2 of the checks; none when even the last fails."""
    from dlo.plan.limits import Limits
    from dlo.plan.limits_fit import candidates, largest_passing
    from dlo.plan.memory_model import Geometry

    base, geometry = Limits(), Geometry(16, 4)
    order = list(candidates(base, geometry))
    assert len(order) > 8
    for first in range(len(order)):
        asked = []

        def check(limits, first=first):
            asked.append(limits)
            if order.index(limits) < first:
                raise ValueError("does not fit")
            return order.index(limits)

        got = largest_passing(check, base, geometry, ValueError)
        assert got == (order[first], first)
        assert len(asked) <= 2 + (len(order) - 1).bit_length()
    assert largest_passing(lambda c: (_ for _ in ()).throw(ValueError()), base, geometry, ValueError) is None
