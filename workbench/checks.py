"""Small checks shared by the config dataclasses: each raises ConfigError naming the field
(`Owner.field`), the value and the fix, on the driver, before any remote work. An empty owner
names the field alone (a run config's dotted path, e.g. "placement.actor_devices")."""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable

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


def real(owner: str, field: str, value: Any, low: float | None = None, high: float | None = None,
         low_open: bool = False, high_open: bool = False, fix: str = "", none_ok: bool = False) -> None:
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


FIELD_STAGES = {
    "scores": "reward", "token_level_scores": "reward", "costs": "cost", "token_level_costs": "cost",
    "token_level_rewards": "reward_shaping", "token_level_kl": "reward_shaping", "values": "values",
    "cost_values": "cost_values", "old_log_probs": "old_log_prob", "rollout_log_probs": "gen",
    "ref_log_probs": "ref", "advantages": "adv", "returns": "adv", "cost_advantages": "adv",
    "cost_returns": "adv",
}
"""The fields an update reads, and the stage that makes each."""


def finite_batch(batch, before: str) -> None:
    """Refuse NaN/inf in the fields an update reads (response tokens only: padding is never
    read), on the driver, before `before` (an update) runs; see errors.NonFiniteError."""
    import torch

    from workbench.errors import NonFiniteError

    mask = batch["response_mask"].bool() if "response_mask" in batch else None
    for field, stage in FIELD_STAGES.items():
        if field not in batch:
            continue
        values = batch[field]
        if not torch.is_floating_point(values):
            continue
        bad = ~torch.isfinite(values)
        if bad.dim() == 2 and mask is not None and bad.shape == mask.shape:
            bad &= mask
        rows = bad.reshape(len(bad), -1).any(dim=1).nonzero().flatten().tolist()
        if rows:
            uids = [batch["uid"][r] for r in rows] if "uid" in batch else rows
            raise NonFiniteError(field, stage, list(uids), before)
