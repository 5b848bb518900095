"""What every trained model's worker shares: the update loop (epochs x mini-batches x
micro-batches), the per-rank state a checkpoint keeps beside the engine's shards, and the export
of the trained weights as a Hugging Face directory."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from workbench.data.batch import Batch
from workbench.engines.accumulation import NonFiniteStep, all_reduce_small, combine_metrics, reduction
from workbench.engines.budget import micro_batches
from workbench.engines.contract import Forward, LossFn
from workbench.errors import ConfigError
from workbench.models.lora import LoRAConfig, is_trained, save_lora


def check_mini_batch_splits(owner: str, mini_batch_size: int, dp: int, role: str) -> None:
    """A mini-batch splits evenly over the group's data-parallel ranks (`run_updates` takes
    mini_batch_size // dp rows per rank and step)."""
    if mini_batch_size % dp:
        raise ConfigError(
            f"{owner}.mini_batch_size",
            mini_batch_size,
            f"it is split over the {role} group's {dp} data-parallel ranks; use a multiple of {dp}",
        )


def check_rows_split(owner: str, mini_batch_size: int, rows: int, role: str) -> None:
    """An update over `rows` rows takes mini-batches of mini_batch_size rows: all equal (a
    mini_batch_size above the rows is one step over all of them)."""
    if rows > mini_batch_size and rows % mini_batch_size:
        steps = [mini_batch_size] * (rows // mini_batch_size) + [rows % mini_batch_size]
        raise ConfigError(
            f"{owner}.mini_batch_size",
            mini_batch_size,
            f"the {role} update gets {rows} rows, which would make uneven optimizer steps of "
            f"{steps} rows; use a mini_batch_size that divides {rows} (rebuild the {role} group), "
            f"or change the number of prompts / samples",
        )


def run_updates(
    engine,
    batch: Batch,
    loss_fn: LossFn,
    forward: Forward,
    rows_per_step: int,
    micro_batch_size: int,
    epochs: int = 1,
    shuffle_seed: int | None = None,
    max_tokens: int | None = None,
) -> dict[str, float]:
    """Optimizer steps over this rank's rows; returns metrics averaged over the steps.

    rows_per_step: this rank's share of a mini-batch (mini_batch_size // dp). Every rank runs
    the same number of steps (DP_PROTO gives ranks equal row counts), as FSDP's collectives need.
    max_tokens: micro-batches filled up to this many tokens instead of micro_batch_size rows
    (workbench.engines.budget), as many on every data-parallel rank.
    """
    rows_per_step = max(1, rows_per_step)
    steps = []
    for epoch in range(epochs):
        order = torch.arange(len(batch))
        if shuffle_seed is not None:
            order = torch.randperm(len(batch), generator=torch.Generator().manual_seed(shuffle_seed + epoch))
        for start in range(0, len(batch), rows_per_step):
            mini = batch[order[start : start + rows_per_step]]
            micro = micro_batches(mini, micro_batch_size, max_tokens, getattr(engine, "dp_group", None))
            try:
                steps.append(engine.train_step(loss_fn, micro, forward))
            except NonFiniteStep as e:
                uids = list(mini["uid"])[:8] if "uid" in mini else "?"
                raise NonFiniteStep(
                    f"optimizer step {len(steps) + 1} of this update (rows uid {uids}...): {e}. "
                    f"{len(steps)} earlier step(s) of this update were applied"
                    + (": restore the last checkpoint to undo them" if steps else "; no weight changed")
                ) from None
    return combine_metrics(steps, [1 / len(steps)] * len(steps))


def mean_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Each metric over the group's ranks (all-reduce), so any rank can report them: the mean,
    or for an extreme by name (accumulation.reduction) the max / min; an extreme no rank had a
    token for is 0."""
    keys = {how: [k for k in metrics if reduction(k) == how] for how in ("mean", "max", "min")}
    out: dict[str, float] = {}
    if keys["mean"]:
        values = all_reduce_small(torch.tensor([metrics[k] for k in keys["mean"]], dtype=torch.float64))
        out |= dict(zip(keys["mean"], (values / dist.get_world_size()).tolist()))
    if keys["max"] or keys["min"]:  # one MAX over [max..., -min...]
        signed = [metrics[k] for k in keys["max"]] + [-metrics[k] for k in keys["min"]]
        reduced = all_reduce_small(torch.tensor(signed, dtype=torch.float64), op=dist.ReduceOp.MAX).tolist()
        extremes = reduced[: len(keys["max"])] + [-v for v in reduced[len(keys["max"]) :]]
        out |= {k: v if math.isfinite(v) else 0.0 for k, v in zip(keys["max"] + keys["min"], extremes)}
    return {k: out[k] for k in metrics}


def rng_state() -> dict:
    """This process's random number generators (torch, CUDA when present, Python, NumPy)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what rng_state() returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_rank_state(path: str, rank: int, **counters: int) -> None:
    """This rank's random number generators and the worker's counters, beside the engine's
    shards: dropout, unseeded sampling and shuffles continue exactly after a resume."""
    Path(path).mkdir(parents=True, exist_ok=True)
    torch.save({"counters": counters, **rng_state()}, Path(path) / f"rank{rank}.state.pt")


def load_rank_state(path: str, rank: int) -> dict[str, int]:
    """Restore what save_rank_state wrote for this rank; returns the counters ({} when the
    checkpoint has none: one saved by an older version, weights and optimizer only)."""
    file = Path(path) / f"rank{rank}.state.pt"
    if not file.exists():
        return {}
    state = torch.load(file, weights_only=False)
    set_rng_state(state)
    return state["counters"]


def export_trained(
    engine,
    rank: int,
    path: str,
    template: Callable[[], Any],  # a transformers PreTrainedModel
    lora: LoRAConfig | None,
    merged: bool = False,
    trained_heads: tuple[str, ...] = (),
) -> None:
    """The engine's weights as a Hugging Face directory under `path`, written by rank 0 into
    `template()` (an unsharded model from the base directory). With LoRA: a peft adapter
    directory (only the adapters travel; `trained_heads` are trained whole), or the base with
    them merged in. Every rank calls it: the gather is a collective."""
    if lora is not None:
        adapters = engine.gather_weights(is_trained)
        if rank == 0:
            save_lora(template(), lora, adapters, path, merged, trained_heads=trained_heads)
        return
    weights = engine.full_weights() if engine is not None else None
    if rank == 0:
        model = template()
        if weights is not None:
            model.load_state_dict(weights)
        model.save_pretrained(path)
