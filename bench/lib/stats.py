"""Every figure with its spread, and ratios whose two sides are the same statistic.

Owns: `spread` (a figure's samples as {first, median, n, min, max}: the first request apart, so
a cold first call is never hidden by the warm ones), `ratio` (two spreads of one call divided
statistic by statistic: the medians, and the first requests where both have one) and `text` (one
figure in words, its spread included); `kept` (a call that kept only its fastest try: n=1, best
of K), `either_ratio` and `figure_text`/`any_ratio_text` (a spread or a kept figure, labelled which).
Must never: pick the best of several tries as a figure; a minimum is shown only beside its median.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

NOT_RECORDED = "not recorded"


def spread(samples: Sequence[float], *, first: float | None | str = "samples[0]") -> dict[str, Any]:
    """{first, median, n, min, max} of `samples`. `first` is the first request: by default the first
    sample (the samples are every request in order); a float when the first was timed apart; None
    when it was never timed (warm-up calls untimed), which the record then says."""
    if not samples:
        raise ValueError("a figure needs at least one sample")
    xs = [float(x) for x in samples]
    head = xs[0] if first == "samples[0]" else first
    return {"first": head, "median": statistics.median(xs), "n": len(xs), "min": min(xs), "max": max(xs)}


def ratio(num: dict[str, Any], den: dict[str, Any]) -> dict[str, Any]:
    """`num / den` for two spreads of the same call: the medians' ratio, and the first requests'
    where both were recorded (None otherwise), with each side's n."""
    first = None
    if isinstance(num.get("first"), (int, float)) and isinstance(den.get("first"), (int, float)) and den["first"]:
        first = num["first"] / den["first"]
    return {"median": num["median"] / den["median"], "first": first, "n": [num["n"], den["n"]]}


def _num(x: float, digits: int) -> str:
    return f"{x:,.{digits}f}"


def text(s: dict[str, Any], unit: str = "", *, scale: float = 1.0, digits: int = 0, first: bool = True) -> str:
    """'509 ms (median of 3: 509-510; first 512)': the median, its n, min-max and (with `first`) the
    first request, or that it was not recorded."""
    med = _num(s["median"] * scale, digits) + unit
    if s["n"] == 1:
        body = "one sample"
    else:
        body = f"median of {s['n']}: {_num(s['min'] * scale, digits)}-{_num(s['max'] * scale, digits)}"
    head = s.get("first")
    if first:
        body += f"; first {_num(head * scale, digits)}" if isinstance(head, (int, float)) else f"; first {NOT_RECORDED}"
    return f"{med} ({body})"


def ratio_text(r: dict[str, Any], digits: int = 3) -> str:
    first = f", first requests {r['first']:.{digits}f}x" if r.get("first") is not None else ""
    return f"{r['median']:.{digits}f}x (medians{first})"


def kept(value: float, best_of: int | str | None = None) -> dict[str, Any]:
    """A call that kept one figure only (the fastest of its tries, the others not recorded): n=1,
    and how many tries it was the best of (or that this was not recorded)."""
    return {"kept": float(value), "n": 1, "best_of": best_of if best_of is not None else NOT_RECORDED}


def either_ratio(num: dict[str, Any], den: dict[str, Any], digits: int = 4) -> dict[str, Any]:
    """`ratio` where both sides kept their samples; where a side kept only its fastest try, the
    fastest over the fastest (the other side's min), labelled so with each side's n: never a median."""
    if "median" in num and "median" in den:
        r = ratio(num, den)
        return {**r, "median": round(r["median"], digits),
                "first": round(r["first"], digits) if r["first"] is not None else None}
    a, b = num.get("min", num.get("kept")), den.get("min", den.get("kept"))
    return {"fastest_over_fastest": round(a / b, digits), "n": [num["n"], den["n"]],
            "statistic": "a side kept only its fastest try: fastest over fastest, not a median"}


def figure_text(s: dict[str, Any], unit: str = "", digits: int = 3) -> str:
    """`text` for a spread; for a kept figure 'x s (n=1, best of K)'."""
    if "median" in s:
        return text(s, unit, digits=digits)
    return f"{s['kept']:.{digits}f}{unit} (n=1, best of {s['best_of']})"


def any_ratio_text(r: dict[str, Any], digits: int = 3) -> str:
    if "median" in r:
        return ratio_text(r, digits)
    return f"{r['fastest_over_fastest']:.{digits}f}x (fastest over fastest, n={r['n'][0]}/{r['n'][1]})"
