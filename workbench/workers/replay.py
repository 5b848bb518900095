"""Replay: one held batch through several variants of the actor's update, side by side, without
disturbing the run (the registered `replay_update` behind `Algorithm.replay`).

Each variant is a real update, the live one's own code (its optimizer steps, clipping and
metrics), taken on this rank's engine and then rewound from an in-memory snapshot
(workbench.engines.snapshot): weights, optimizer state, random generators and counters are bit
for bit as before. What each variant did to the weights, its update direction, stays on the
ranks: they return only the dot products between the variants' directions, summed over the
ranks (each shard counted once), from which the driver takes norms and cosines.

Mixed into the actor (it brings the snapshot methods, workbench.workers.snapshots); the worker
supplies `_update(batch, loss_fn)` (its update's steps on this rank, returning this rank's
metrics), `_log_probs(batch)`, and what Snapshots asks for."""

from __future__ import annotations

import torch

from workbench.controller import THREE_D_REDUCED, register
from workbench.data.batch import Batch
from workbench.engines import snapshot as engine_snapshot
from workbench.engines.accumulation import all_reduce_small
from workbench.engines.contract import LossFn
from workbench.workers.snapshots import Snapshots
from workbench.workers.updates import mean_over_ranks, rng_state, set_rng_state

ADVANTAGES = "replay_advantages__"
"""A variant's own advantages travel as the column ADVANTAGES + its name (split with the rows)."""

CHUNK = 1 << 22
"""Elements per float64 piece of a dot product (bounds the temporary's memory)."""


def with_own_advantages(batch: Batch, name: str) -> Batch:
    """The batch a variant updates on: its own advantages where it has them, no replay columns."""
    rows = batch.select(*[k for k in batch.keys() if not k.startswith(ADVANTAGES)])
    if ADVANTAGES + name in batch:
        rows["advantages"] = batch[ADVANTAGES + name]
    return rows


def dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """sum(a * b) in float64, a piece at a time."""
    return sum(float(a[i : i + CHUNK].double() @ b[i : i + CHUNK].double()) for i in range(0, a.numel(), CHUNK))


class Replay(Snapshots):
    """Registered replay_update (and the snapshot methods it builds on)."""

    version: int
    """The worker's weight version (a rollout copy syncs when it moves)."""

    @register(THREE_D_REDUCED)
    def replay_update(self, batch: Batch, losses: dict[str, LossFn], kl: bool = False) -> dict:
        """Each variant's update (`losses[name]`, on the batch with its advantages) taken, measured
        and rewound. Returns {"metrics": {name: its update's metrics}, "dots": the variants' update
        directions' dot products (k x k, over every rank)}; with `kl`, each variant's metrics also
        hold replay/kl_to_current: the mean KL(current || updated) over the batch's response
        tokens (k3 estimate), from one forward before and one per variant."""
        engine = self._trained()
        held, rng, counters, version = engine_snapshot.take(engine), rng_state(), self._counters(), self.version
        before = [t.clone() for t in engine_snapshot.owned(engine)]
        current = self._log_probs(batch) if kl else None
        metrics: dict[str, dict[str, float]] = {}
        directions: list[torch.Tensor] = []
        try:
            for name, loss_fn in losses.items():
                rows = with_own_advantages(batch, name)
                taken = self._update(rows, loss_fn)
                now = engine_snapshot.owned(engine)
                directions.append(torch.cat([(a - b).reshape(-1) for a, b in zip(now, before)] or [torch.zeros(0)]))
                if current is not None:
                    taken["replay/kl_to_current"] = kl_to(current, self._log_probs(rows), rows["response_mask"])
                metrics[name] = mean_over_ranks(taken)
                rewind(engine, held, rng)
        except BaseException:
            rewind(engine, held, rng)  # a variant that failed: the run goes on as it was
            raise
        finally:
            self._restored(counters)
            self.version = version  # the same weights: a rollout copy stays current
        k = len(directions)
        dots = [[0.0] * k for _ in range(k)]
        for i in range(k):
            for j in range(i, k):
                dots[i][j] = dots[j][i] = dot(directions[i], directions[j])
        return {"metrics": metrics, "dots": all_reduce_small(torch.tensor(dots, dtype=torch.float64)).tolist()}

    def _update(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        raise NotImplementedError(f"{type(self).__name__} replays its update: give it an _update(batch, loss_fn)")

    def _log_probs(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} measures KL on log-probs: give it a _log_probs(batch)")


def rewind(engine, held, rng) -> None:
    engine_snapshot.restore(engine, held)
    set_rng_state(rng)


def kl_to(current: torch.Tensor, updated: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over every rank's response tokens of k3(current, updated) = e^r - 1 - r, r = updated - current."""
    ratio = (updated - current).double()
    k3 = (torch.exp(ratio) - 1 - ratio) * mask
    # Tensor and pipeline ranks of one replica hold the same rows: numerator and denominator
    # count them equally often, so the mean is the mean over the rows.
    total = all_reduce_small(torch.stack([k3.sum(), mask.sum().double()]))
    return float(total[0] / total[1].clamp(min=1))
