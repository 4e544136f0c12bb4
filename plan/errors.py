"""The one error a setting or a plan input that describes nothing valid raises, and its checks.

Owns: `ConfigError` (the message names the setting and what it accepts; `dlo serve` and `dlo plan`
print it in one line and exit 2) and the small checks that raise it (`one_of`, `whole`, `flag`),
shared by the plan's objects and the engine's settings.
Must never: import anything but the standard library.
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A setting that describes no valid engine; the message names the setting and what it accepts."""


def one_of(name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def whole(name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f"from {low} to {high}" if high is not None else f">= {low}"
        raise ConfigError(f"{name} must be an integer {span}, got {value!r}")


def flag(name: str, value: Any, *, optional: bool = False) -> None:
    if not (isinstance(value, bool) or (optional and value is None)):
        raise ConfigError(f"{name} must be true or false{' (or unset)' if optional else ''}, got {value!r}")
