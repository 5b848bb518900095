"""Small checks shared by the config dataclasses: each raises ConfigError naming the field
(`Owner.field`), the value and the fix, on the driver, before any remote work. An empty owner
names the field alone (a run config's dotted path, e.g. "placement.actor_devices")."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any

from workbench.errors import ConfigError


def where(owner: str, field: str) -> str:
    """How an error names the field: `Owner.field`, or `field` alone when there is no owner."""
    return f"{owner}.{field}" if owner else field


def is_whole(value: Any, low: int | None = None) -> bool:
    """A whole number (not a bool), >= low when given."""
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    return ok and (low is None or value >= low)


def is_real(value: Any) -> bool:
    """A finite number (not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def whole(owner: str, field: str, value: Any, low: int = 1, fix: str = "", none_ok: bool = False) -> None:
    """A whole number >= low; None when none_ok."""
    if value is None and none_ok:
        return
    if not is_whole(value, low):
        raise ConfigError(where(owner, field), value, fix or f"use a whole number >= {low}")


def real(
    owner: str,
    field: str,
    value: Any,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    fix: str = "",
    none_ok: bool = False,
) -> None:
    """A finite number in [low, high] (bounds open where asked); None when none_ok."""
    if value is None and none_ok:
        return
    ok = is_real(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {high}"
        bounds = " and ".join(b for b in (lo, hi) if b) or "finite"
        raise ConfigError(where(owner, field), value, fix or f"use a number {bounds}")


def one_of(owner: str, field: str, value: Any, choices: Iterable, fix: str = "") -> None:
    choices = list(choices)
    if value not in choices:
        raise ConfigError(where(owner, field), value, fix or f"use one of {choices}")


def of_type(owner: str, field: str, value: Any, kind: type | tuple, fix: str) -> None:
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool) and bool not in _types(kind)):
        raise ConfigError(where(owner, field), value, fix)


def _types(kind) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)
