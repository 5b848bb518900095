"""Training forwards run ahead of their optimizer step and kept, autograd graph and all.

PPO reads the critic's values V_old before the critic's update. When that update is one
optimizer step over the same rows (one epoch, one mini-batch), its training forward sees the
same weights and the same rows again, and gives the same values. So the values call can run
the training forward itself, with gradients, hand back the values detached, and keep the
outputs; the update then backpropagates through them instead of computing them a second time.
One forward per iteration saved, exactly; the price is holding that forward's activations
from the values call until the update.
"""

from __future__ import annotations

import torch

from workbench.data.batch import Batch
from workbench.engines.contract import Forward, Outputs

IDENTITY = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
"""The columns a forward reads: two micro-batches that agree on these get the same outputs."""


def same_rows(a: Batch, b: Batch) -> bool:
    return len(a) == len(b) and all(
        (key in a) == (key in b) and (key not in a or torch.equal(a[key], b[key])) for key in IDENTITY
    )


class KeptForwards:
    """Outputs of `forward(model, micro_batch)` for each micro-batch, graphs attached. Valid
    until the weights change: whoever changes them drops the kept forwards."""

    def __init__(self, model: torch.nn.Module, micro_batches: list[Batch], forward: Forward):
        model.train()  # the mode of the training step that will use them
        self.micro_batches = micro_batches
        self.outputs: list[Outputs] = [forward(model, mb) for mb in micro_batches]
        self.reused = 0

    def forward(self, fallback: Forward) -> Forward:
        """A forward for the training step: the kept outputs of a micro-batch whose rows are the
        kept ones, in order; a fresh `fallback` forward for any other."""

        def forward(model: torch.nn.Module, micro_batch: Batch) -> Outputs:
            if self.reused < len(self.outputs) and same_rows(self.micro_batches[self.reused], micro_batch):
                self.reused += 1
                return self.outputs[self.reused - 1]
            return fallback(model, micro_batch)

        return forward
