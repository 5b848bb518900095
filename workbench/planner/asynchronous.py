"""The iteration model of an asynchronous plan (algorithms.pipeline): generation on a rollout
pool of its own overlapping the trainer's work on another pool.

Synchronous on split pools, an iteration is generation, then the trainer's calls, then the weight
push, one after another. With `max_staleness` >= 1 the rollout generates the next batch while the
trainer trains on this one, and the push waits for both sides (the rollout takes the weights after
its generation in flight, the trainer sends them after its update), so in steady state an
iteration costs the slower side plus the push. A run of N iterations also pays one generation
before the first (the pipeline's fill). Pure functions of seconds: from the simulator's call-time
estimates (the cost model) or from a run's measured call times (`bench/async_rl.py`).
"""

from __future__ import annotations

from dataclasses import dataclass


def steady_iteration(generate_s: float, train_s: float, push_s: float, max_staleness: int) -> float:
    """Seconds per iteration in steady state: the sum (max_staleness=0), else the slower side + the push."""
    if min(generate_s, train_s, push_s) < 0 or max_staleness < 0:
        raise ValueError("steady_iteration: seconds and max_staleness must be >= 0")
    if max_staleness == 0:
        return generate_s + train_s + push_s
    return max(generate_s, train_s) + push_s


@dataclass(frozen=True)
class AsyncEstimate:
    """An asynchronous plan's iteration, and where its time goes."""

    iteration_s: float
    total_s: float
    """N iterations, the pipeline's fill included."""
    bottleneck: str
    """ "rollout" or "trainer": the side the other waits for."""
    idle_rollout: float
    """Fraction of an iteration the rollout pool waits (0 for the bottleneck)."""
    idle_trainer: float


def estimate(
    generate_s: float, train_s: float, push_s: float, max_staleness: int, iterations: int = 1
) -> AsyncEstimate:
    """The iteration model of a split plan run with `max_staleness`, over `iterations` iterations."""
    step = steady_iteration(generate_s, train_s, push_s, max_staleness)
    fill = generate_s if max_staleness else 0.0
    total = fill + iterations * step if max_staleness else iterations * step
    busy_rollout, busy_trainer = generate_s + push_s, train_s + push_s
    return AsyncEstimate(
        iteration_s=step,
        total_s=total,
        bottleneck="rollout" if generate_s >= train_s else "trainer",
        idle_rollout=max(0.0, 1 - busy_rollout / step) if step else 0.0,
        idle_trainer=max(0.0, 1 - busy_trainer / step) if step else 0.0,
    )
