"""Replay: hold one batch fixed and put it through several variants of the actor's update, side by
side, without disturbing the run.

    result = algo.replay(batch, {
        "live": {},                                            # the config as it is
        "dr_grpo": {"estimator": "drgrpo", "loss_agg_mode": "seq-mean-token-sum-norm"},
        "gspo": {"policy_loss": "gspo"},
        "tis": {"off_policy_correction": "tis", "is_cap": 2.0},
        "mine": {"estimator": my_estimator},                   # any function defined in a cell
    })
    result.table()        # per variant: advantages, loss terms, clip fraction, grad norm, ...
    result.cosines()      # between the variants' update directions

A variant is a set of changes to the algorithm's config (any field: estimator, policy_loss, clip
ranges, loss_agg_mode, off_policy_correction and is_cap, kl_loss_coef, entropy_coeff, or kl_coef,
which re-shapes the rewards with that fixed coefficient). The driver computes each variant's
advantages and loss; the actor's ranks then take each variant's real update, the live update's
own code, on the batch, measure it and rewind it from an in-memory snapshot
(workbench.workers.replay): the live weights, optimizer state and random generators are bit for
bit as before, so the run goes on as if nothing happened. The update directions never leave the
ranks; only their dot products come back.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from algorithms import core
from algorithms.guard import finite_batch
from workbench.data.batch import Batch
from workbench.errors import ConfigError

SHOWN = (
    ("advantage |A| mean", "replay/abs_advantage"),
    ("zero-advantage tokens", "replay/zero_advantage_frac"),
    ("pg_loss", "actor/pg_loss"),
    ("clip fraction", "actor/pg_clipfrac"),
    ("kl_loss", "actor/kl_loss"),
    ("is weight mean", "actor/is_weight_mean"),
    ("is capped", "actor/is_capped_frac"),
    ("grad norm", "actor/grad_norm"),
    ("update norm", "replay/update_norm"),
    ("KL to current", "replay/kl_to_current"),
)
"""The table's columns: (heading, metric); a metric no variant has is left out."""


@dataclass
class ReplayResult:
    """What each variant's update did to one batch, by variant name."""

    changes: dict[str, dict[str, Any]]
    """Each variant's config changes, as given."""
    metrics: dict[str, dict[str, float]]
    """Each variant's update metrics (the live update's keys), with replay/abs_advantage,
    replay/zero_advantage_frac, replay/update_norm (and replay/kl_to_current when asked)."""
    advantages: dict[str, torch.Tensor] = field(repr=False)
    """Each variant's per-token advantages (rows x response tokens; 0 off the response)."""
    response_mask: torch.Tensor = field(repr=False)
    dots: list[list[float]] = field(repr=False)
    """Dot products of the variants' update directions (the change of every trained weight),
    in the order of `changes`."""

    @property
    def names(self) -> list[str]:
        return list(self.changes)

    def cosines(self) -> dict[str, dict[str, float]]:
        """cos(update a, update b) for every pair; 0 where an update did not move."""
        norms = [math.sqrt(max(self.dots[i][i], 0.0)) for i in range(len(self.names))]
        return {
            a: {
                b: self.dots[i][j] / (norms[i] * norms[j]) if norms[i] and norms[j] else 0.0
                for j, b in enumerate(self.names)
            }
            for i, a in enumerate(self.names)
        }

    def table(self) -> list[dict[str, Any]]:
        """One row per variant: its name, its changes and the SHOWN metrics it has."""
        shown = [(heading, key) for heading, key in SHOWN if any(key in m for m in self.metrics.values())]
        return [
            {"variant": name, "changes": describe(self.changes[name])}
            | {heading: self.metrics[name].get(key, math.nan) for heading, key in shown}
            for name in self.names
        ]

    def __repr__(self) -> str:
        rows = self.table()
        columns = list(rows[0]) if rows else []
        cells = [[format_cell(row[c]) for c in columns] for row in rows]
        widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
        lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
        return "\n".join(lines)


def describe(changes: Mapping[str, Any]) -> str:
    """'estimator=drgrpo, loss_agg_mode=seq-mean-token-sum-norm' ('live config' for none)."""
    if not changes:
        return "live config"
    return ", ".join(f"{k}={getattr(v, '__name__', v)}" for k, v in changes.items())


def format_cell(value: Any) -> str:
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def variant_config(algorithm, name: str, changes: Mapping[str, Any]):
    """The algorithm's config with `changes`, checked as a config is."""
    if not isinstance(changes, Mapping):
        raise ConfigError(
            f"replay variant {name!r}",
            changes,
            "give a dict of config changes, e.g. {'estimator': 'drgrpo'} ({} = the live config)",
        )
    fields = {f.name for f in dataclasses.fields(algorithm.config)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise ConfigError(
            f"replay variant {name!r}",
            unknown,
            f"not fields of {type(algorithm.config).__name__}; change any of {sorted(fields)}",
        )
    try:
        return dataclasses.replace(algorithm.config, **changes)
    except (ConfigError, ValueError, TypeError) as e:
        raise ConfigError(f"replay variant {name!r}", dict(changes), str(e)) from None


def variant_rows(batch: Batch, changes: Mapping[str, Any], config) -> Batch:
    """The batch's rows with the variant's rewards and advantages (a copy: `batch` stays)."""
    rows = batch.select(*batch.keys())
    if {"kl_coef", "kl_penalty"} & set(changes):  # the in-reward KL with this fixed coefficient
        needed = [k for k in ("token_level_scores", "old_log_probs", "ref_log_probs") if k not in rows]
        if needed and config.kl_coef:
            raise ConfigError(
                "replay variant kl_coef",
                changes.get("kl_coef"),
                f"re-shaping the rewards needs the batch's {needed}; replay a batch from a step with a reference",
            )
        if config.kl_coef:
            rows["token_level_rewards"], _ = core.kl_in_reward(
                rows["token_level_scores"],
                rows["old_log_probs"],
                rows["ref_log_probs"],
                rows["response_mask"],
                config.kl_coef,
                config.kl_penalty,
            )
        elif "token_level_scores" in rows:
            rows["token_level_rewards"] = rows["token_level_scores"]
    estimator = core.ADVANTAGES.get(config.estimator)
    rows["advantages"], rows["returns"] = core.call(
        estimator, rows, config.settings(), what=f"advantage estimator {config.estimator!r}"
    )
    return rows


def replay(algorithm, batch: Batch, variants: Mapping[str, Mapping[str, Any]], kl: bool = False) -> ReplayResult:
    """Each variant's update on `batch`, measured and rewound on the actor (see the module)."""
    # Here, not at the top: the workers' side loads the training engines (seconds a kernel).
    from workbench.workers.replay import ADVANTAGES

    actor = algorithm.groups.actor
    if "replay_update" not in getattr(actor, "methods", ()):
        raise ConfigError(
            f"{type(algorithm).__name__} role 'actor'",
            type(actor).__name__,
            "replay takes real updates on the actor's ranks: give it a trained ActorRolloutRefWorker group",
        )
    if not variants:
        raise ConfigError("replay variants", variants, "give at least one, e.g. {'live': {}}")
    needed = [k for k in ("response_mask", "token_level_rewards") if k not in batch]
    if needed:
        raise ConfigError(
            "replay batch",
            sorted(batch.keys()),
            f"missing {needed}: replay a batch an iteration returned (`batch, metrics = algo.step(prompts)`)",
        )
    pi_old_from_update = "old_log_probs" not in batch
    losses, advantages, changes = {}, {}, {}
    shipped = batch.select(*batch.keys())
    mask = batch["response_mask"]
    for name, change in variants.items():
        config = variant_config(algorithm, name, change)
        rows = variant_rows(batch, change, config)
        finite_batch(rows, before=f"replay variant {name!r}")
        needs = {"ref_log_probs": config.kl_loss_coef, "rollout_log_probs": config.off_policy_correction != "none"}
        missing = [column for column, needed in needs.items() if needed and column not in batch]
        if missing:
            raise ConfigError(
                f"replay variant {name!r}",
                dict(change),
                f"its loss reads the batch's {missing}, which this batch has not: replay a batch whose iteration "
                "computed them (a reference for kl_loss_coef, the workbench's rollout for a correction)",
            )
        shipped[ADVANTAGES + name] = advantages[name] = rows["advantages"]
        losses[name] = algorithm.actor_loss(config, pi_old_from_update)
        changes[name] = dict(change)
    answer = actor.replay_update(shipped, losses, kl).get()
    metrics = answer["metrics"]
    for i, name in enumerate(changes):
        valid = mask.bool()
        adv = advantages[name][valid]
        metrics[name] |= {
            "replay/abs_advantage": float(adv.abs().mean()) if adv.numel() else 0.0,
            "replay/zero_advantage_frac": float((adv == 0).float().mean()) if adv.numel() else 0.0,
            "replay/update_norm": math.sqrt(max(answer["dots"][i][i], 0.0)),
        }
    return ReplayResult(changes, metrics, advantages, mask, answer["dots"])
