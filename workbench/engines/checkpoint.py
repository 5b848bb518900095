"""Sharded model + optimizer checkpoints with torch.distributed.checkpoint (each rank its shard),
for the engines whose parameters are DTensors (FSDP2, tensor parallel).

One trap handled here: `get_state_dict` on an optimizer that has not stepped yet makes its state
by running a step with zero gradients at lr 0. That leaves Adam's step count at 1, so the first
real step after a checkpoint taken before training would use the wrong bias correction (a
different update than without the checkpoint). Such a checkpoint is marked as holding a fresh
optimizer, and the optimizer is made fresh again after saving it and after loading it. Fresh
means no gradients either: torch makes that state only where no parameter holds a gradient, so
the last step's leftover gradients (engines clear them at the start of a step, not the end) would
leave the checkpoint without optimizer state, which a stepped optimizer then cannot load.

A model with frozen parameters (LoRA: the base) checkpoints only what trains: the frozen weights
are the model directory's, loaded again at start, so writing them every time would be waste.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

FRESH = "optimizer_not_stepped"
"""Marker file: the checkpoint's optimizer had not taken a step."""


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str, optim_key: str = "optim") -> None:
    """optim_key: where the optimizer's state goes. Ranks whose optimizers hold different
    parameters (pipeline stages) need one each: DCP keeps one copy of a key every rank writes,
    and the param_groups (lists of parameter names) would collide."""
    fresh = not optimizer.state
    if fresh:
        _make_fresh(optimizer)
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(model))
    dcp.save({"model": model_state, optim_key: optim_state}, checkpoint_id=path)
    if fresh:
        _make_fresh(optimizer)
        (Path(path) / FRESH).touch()


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str, optim_key: str = "optim") -> None:
    options = _options(model)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, optim_key: optim_state}
    dcp.load(state, checkpoint_id=path)  # raises if the checkpoint lacks any tensor asked for
    # Not strict where frozen weights were left out: they stay as loaded from the model dir.
    frozen = options.ignore_frozen_params
    options = StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state[optim_key], options=options
    )
    if (Path(path) / FRESH).exists():
        _make_fresh(optimizer)


def _options(model: torch.nn.Module) -> StateDictOptions:
    """Trained parameters only when some are frozen (see the module's note)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen)


def _make_fresh(optimizer: torch.optim.Optimizer) -> None:
    """As just built: no state, no gradients (see the module's note)."""
    optimizer.state.clear()
    optimizer.zero_grad(set_to_none=True)
