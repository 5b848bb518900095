"""The update loop every trained model shares: epochs x mini-batches x micro-batches."""

from __future__ import annotations

import torch
import torch.distributed as dist

from workbench.data.batch import Batch
from workbench.engines.fsdp import LossFn


def run_updates(
    engine, batch: Batch, loss_fn: LossFn, rows_per_step: int, micro_batch_size: int, epochs: int = 1,
    shuffle_seed: int | None = None,
) -> dict[str, float]:
    """Optimizer steps over this rank's rows; returns metrics averaged over the steps.

    rows_per_step: this rank's share of a mini-batch (mini_batch_size // dp). Every rank runs
    the same number of steps (DP_PROTO gives ranks equal row counts), as FSDP's collectives need.
    """
    rows_per_step = max(1, rows_per_step)
    steps = []
    for epoch in range(epochs):
        order = torch.arange(len(batch))
        if shuffle_seed is not None:
            order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(shuffle_seed + epoch))
        for start in range(0, len(batch), rows_per_step):
            mini = batch[order[start : start + rows_per_step]]
            micro = [mini[i : i + micro_batch_size] for i in range(0, len(mini), micro_batch_size)]
            steps.append(engine.train_step(loss_fn, micro))
    return {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}


def mean_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Average each metric over the group's ranks (all-reduce), so any rank can report them."""
    values = torch.tensor(list(metrics.values()), dtype=torch.float64)
    dist.all_reduce(values)
    values /= dist.get_world_size()
    return dict(zip(metrics, values.tolist()))
