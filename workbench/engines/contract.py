"""What every training backend takes: the optimizer's settings and the loss function's shape.

Both backends (FSDP2, DeepSpeed ZeRO, tensor parallel) and `algorithms/` import these from here,
so none of them reaches into another backend's module.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from workbench import checks
from workbench.data.batch import Batch
from workbench.errors import ConfigError

Outputs = dict[str, torch.Tensor]
"""What the model computed for a micro-batch, by name: "log_probs" and "entropy" (B x R, the
actor), "values" (B x R, a critic), "nll" (B, pre-training rows)."""

LossFn = Callable[[Outputs, Batch], tuple[torch.Tensor, dict[str, float]]]
"""loss_fn(outputs, micro_batch) -> (mean loss over the micro-batch's rows, metrics).

The engine owns the forward: a loss sees what the model computed, never the model, so the
engine may cut the model (tensor or pipeline parallel, a vocab-parallel log-softmax) as it
likes. A loss names what it needs in a `needs` attribute (default: the worker's usual
outputs, e.g. ("log_probs",) for the actor)."""

Forward = Callable[[torch.nn.Module, Batch], Outputs]
"""forward(model, micro_batch) -> outputs: the worker's side of a training step."""


def needs(loss_fn, default: tuple[str, ...]) -> tuple[str, ...]:
    """The outputs `loss_fn` asks for."""
    return tuple(getattr(loss_fn, "needs", default))


@dataclass(frozen=True)
class OptimConfig:
    """AdamW settings."""

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping; the norm is still reported)."""

    def __post_init__(self):
        checks.real("OptimConfig", "lr", self.lr, 0, low_open=True, fix="use a learning rate > 0 (e.g. 1e-5)")
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2):
            raise ConfigError("OptimConfig.betas", self.betas, "use two numbers in [0, 1), e.g. (0.9, 0.999)")
        for i, beta in enumerate(self.betas):
            checks.real(
                "OptimConfig", f"betas[{i}]", beta, 0, 1, high_open=True, fix="use betas in [0, 1), e.g. (0.9, 0.999)"
            )
        checks.real("OptimConfig", "eps", self.eps, 0, low_open=True, fix="use eps > 0 (e.g. 1e-8)")
        checks.real("OptimConfig", "weight_decay", self.weight_decay, 0, fix="use weight_decay >= 0")
        checks.real("OptimConfig", "grad_clip", self.grad_clip, 0, fix="use grad_clip >= 0 (0 = no clipping)")


def check_training_fields(owner: str, config) -> None:
    """The settings every trained model's config shares (ActorConfig, CriticConfig)."""
    if not isinstance(config.model_path, (str, os.PathLike)) or not str(config.model_path):
        raise ConfigError(f"{owner}.model_path", config.model_path, "give a local Hugging Face checkpoint directory")
    checks.whole(
        owner,
        "mini_batch_size",
        config.mini_batch_size,
        fix="use a whole number of rows >= 1 per optimizer step (summed over data-parallel ranks)",
    )
    checks.whole(
        owner,
        "micro_batch_size",
        config.micro_batch_size,
        fix="use a whole number of rows >= 1 per forward/backward on one rank",
    )
    if config.max_tokens_per_micro_batch is not None:
        checks.whole(
            owner,
            "max_tokens_per_micro_batch",
            config.max_tokens_per_micro_batch,
            fix="use a whole number of tokens >= 1 (at least the longest prompt plus max_new_tokens), or None",
        )
    checks.one_of(owner, "packing", config.packing, (None, True, False), fix="use None (where exact), True or False")
    checks.whole(owner, "epochs", config.epochs, fix="use a whole number of passes >= 1 over each batch")
    checks.whole(owner, "seed", config.seed, low=0, fix="use a whole number >= 0")
    checks.of_type(owner, "optim", config.optim, OptimConfig, "pass a workbench.OptimConfig(lr=...)")
