"""Micro-batch weights: rows by default, the loss's own weight (tokens for a token mean) if it has one."""

import torch

from algorithms import core
from algorithms.losses import token_weight
from workbench import Batch
from workbench.engines.accumulation import micro_batch_weights


class TokenMean:
    def weight(self, batch):
        return token_weight(batch, "token-mean")


def test_rows_by_default_and_tokens_for_a_token_mean_loss():
    short = Batch({"response_mask": torch.tensor([[1, 0, 0, 0, 0, 0, 0, 0, 0]])})
    long = Batch({"response_mask": torch.ones(2, 9, dtype=torch.long)})
    grads, shares = micro_batch_weights(lambda m, b: None, [short, long])
    assert grads == shares == [1 / 3, 2 / 3]
    grads, shares = micro_batch_weights(TokenMean(), [short, long])
    assert grads == shares == [1 / 19, 18 / 19]
    # the weighted per-micro-batch token means are the token mean of the whole step
    losses = torch.rand(3, 9)
    parts = [core.aggregate(losses[:1], short["response_mask"]), core.aggregate(losses[1:], long["response_mask"])]
    whole = core.aggregate(losses, torch.cat([short["response_mask"], long["response_mask"]]))
    assert torch.allclose(sum(w * p for w, p in zip(grads, parts)), whole)


def test_per_row_means_weigh_only_rows_that_have_tokens():
    """An empty row adds nothing to a per-row mean, so a micro-batch holding one weighs less."""
    masks = [torch.tensor([[1, 1, 0], [0, 0, 0]]), torch.tensor([[1, 0, 0], [1, 1, 1]])]
    losses = torch.rand(4, 3)
    for mode in ("seq-mean-token-sum", "seq-mean-token-mean"):

        class Loss:
            def weight(self, batch):
                return token_weight(batch, mode)

        grads, _ = micro_batch_weights(Loss(), [Batch({"response_mask": m}) for m in masks])
        assert grads == [1 / 3, 2 / 3]
        parts = [core.aggregate(losses[:2], masks[0], mode), core.aggregate(losses[2:], masks[1], mode)]
        whole = core.aggregate(losses, torch.cat(masks), mode)
        assert torch.allclose(sum(w * p for w, p in zip(grads, parts)), whole)
