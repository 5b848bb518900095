"""Sharded checkpoints in one process (torch.distributed.checkpoint without a process group):
a checkpoint taken before the first optimizer step restores a fresh optimizer, whatever ran
between saving and loading it."""

import copy

import pytest
import torch

from workbench.engines.checkpoint import load_sharded, save_sharded


def adam(model):
    return torch.optim.AdamW(model.parameters(), lr=0.1, foreach=False)


def step(model, optimizer, seed):
    optimizer.zero_grad(set_to_none=True)  # as the engines do: at the start, not the end
    torch.manual_seed(seed)
    model(torch.randn(4, 3)).pow(2).sum().backward()
    optimizer.step()  # leaves the gradients in place


@pytest.mark.filterwarnings("ignore::UserWarning")  # DCP without a process group says so
def test_a_fresh_checkpoint_restores_a_fresh_optimizer_after_training(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    untouched = copy.deepcopy(model)
    optimizer = adam(model)
    save_sharded(model, optimizer, str(tmp_path / "fresh"))
    step(model, optimizer, seed=1)
    load_sharded(model, optimizer, str(tmp_path / "fresh"))  # back to the start: weights and optimizer
    assert not optimizer.state and all(p.grad is None for p in model.parameters())

    save_sharded(model, optimizer, str(tmp_path / "fresh-again"))  # leftover gradients must not matter
    step(model, optimizer, seed=2)
    load_sharded(model, optimizer, str(tmp_path / "fresh-again"))  # refused before: no optimizer state saved

    step(model, optimizer, seed=3)
    reference = copy.deepcopy(untouched)
    step(reference, adam(reference), seed=3)
    for restored, expected in zip(model.parameters(), reference.parameters()):
        assert torch.equal(restored, expected)  # the first step from the checkpoint is a first step
