"""How the micro-batches of one optimizer step are weighted (gradient accumulation).

A loss is a mean over its micro-batch; the step's loss must be the mean over the whole step,
on every rank together. By default each micro-batch weighs its rows. A loss function can say
otherwise with a `weight(micro_batch)` method — a token-mean loss weighs its valid tokens,
so a 1-token and a 9-token response count as 10 tokens, not as two rows. Data-parallel ranks
average their gradients, so each rank's weights are taken as a share of the whole group's
total, times the group size: the result equals one big batch on one process.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from workbench.data.batch import Batch


def collective_device(group=None) -> torch.device:
    """Where a small tensor must live to take part in a collective of `group`: NCCL reduces only
    GPU tensors, gloo CPU ones."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_small(values: torch.Tensor, group=None, op=None) -> torch.Tensor:
    """all_reduce of a few numbers on whichever device the backend needs; the result on CPU."""
    moved = values.to(collective_device(group))
    dist.all_reduce(moved, group=group, **({"op": op} if op is not None else {}))
    return moved.cpu()


def micro_batch_weights(loss_fn, micro_batches: list[Batch], group=None) -> tuple[list[float], list[float]]:
    """(gradient weights, metric weights) per micro-batch. Metric weights are this rank's
    shares (they sum to 1 here; ranks are averaged later); gradient weights are shares of
    the step over every rank of `group` (the DP process group), times its size."""
    weigh = getattr(loss_fn, "weight", len)
    sizes = torch.tensor([float(weigh(mb)) for mb in micro_batches], dtype=torch.float64)
    local = sizes.sum().clamp(min=1e-12)
    total, world = local.clone(), 1
    if group is not None and dist.is_available() and dist.is_initialized():
        world = dist.get_world_size(group)
        total = all_reduce_small(total, group)
    return (sizes * world / total.clamp(min=1e-12)).tolist(), (sizes / local).tolist()


def reduction(key: str) -> str:
    """How a loss metric combines over micro-batches, steps and ranks: an extreme by name
    ("..._max", ".../max": the max; "..._min", ".../min": the min), anything else as a mean."""
    if key.endswith(("_max", "/max")):
        return "max"
    if key.endswith(("_min", "/min")):
        return "min"
    return "mean"


def combine_metrics(parts: list[dict], shares: list[float]) -> dict[str, float]:
    """Metrics of the parts of an update (micro-batches, steps) with their shares (summing to 1):
    the weighted mean, or the extreme over the parts that weigh anything (a padding-only
    micro-batch reports 0 for a max it has no token for; none that weighs: +-inf, which the
    rank reduction, workers.updates.mean_over_ranks, resolves)."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for part in parts for k in part):
        how = reduction(key)
        if how == "mean":
            out[key] = sum(float(part[key]) * share for part, share in zip(parts, shares) if key in part)
            continue
        values = [float(part[key]) for part, share in zip(parts, shares) if key in part and share > 0]
        pick, empty = (max, -math.inf) if how == "max" else (min, math.inf)
        out[key] = pick(values) if values else empty
    return out


def accumulate_gradients(model, loss_fn, micro_batches: list[Batch], forward, group=None) -> dict[str, float]:
    """Forward, loss and backward of every micro-batch of one step into `model`'s gradients,
    each weighted as above; the loss metrics combined over this rank's micro-batches."""
    model.train()
    weights, shares = micro_batch_weights(loss_fn, micro_batches, group)
    parts = []
    for mb, weight in zip(micro_batches, weights):
        loss, metrics = loss_fn(forward(model, mb), mb)
        (loss * weight).backward()
        parts.append(metrics)
    return combine_metrics(parts, shares)


class NonFiniteStep(FloatingPointError):
    """A training step whose loss or gradient norm is NaN/inf: its optimizer step was skipped."""


def finite_everywhere(value: torch.Tensor | float, group=None) -> bool:
    """Whether `value` is finite on every rank of `group` (all ranks get the same answer, so they
    all skip the step together and no collective is left waiting)."""
    flag = torch.tensor([1.0 if bool(torch.isfinite(torch.as_tensor(value)).all()) else 0.0])
    if group is not None and dist.is_available() and dist.is_initialized():
        flag = all_reduce_small(flag, group, op=dist.ReduceOp.MIN)
    return bool(flag.item())
