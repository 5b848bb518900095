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


def test_extremes_combine_as_extremes_and_the_rest_as_weighted_means():
    from workbench.engines.accumulation import combine_metrics

    parts = [
        {"actor/pg_loss": 1.0, "actor/is_weight_max": 1.5, "actor/is_weight_min": 0.9},
        {"actor/pg_loss": 3.0, "actor/is_weight_max": 1.2, "actor/is_weight_min": 0.6},
        {"actor/pg_loss": 9.0, "actor/is_weight_max": 0.0, "actor/is_weight_min": 0.0},  # padding only
    ]
    combined = combine_metrics(parts, [0.25, 0.75, 0.0])
    assert combined["actor/pg_loss"] == 0.25 * 1.0 + 0.75 * 3.0
    assert combined["actor/is_weight_max"] == 1.5 and combined["actor/is_weight_min"] == 0.6
    nothing = combine_metrics(parts[2:], [0.0])  # a rank with no token: the rank reduction decides
    assert nothing["actor/is_weight_max"] == float("-inf") and nothing["actor/is_weight_min"] == float("inf")


def test_ranks_reduce_extremes_as_extremes(tmp_path):
    """mean_over_ranks on two real gloo processes: means averaged, maxima and minima taken."""
    import torch.multiprocessing as mp

    mp.spawn(_two_ranks, args=(str(tmp_path / "store"),), nprocs=2, join=True)


def _two_ranks(rank: int, store: str) -> None:
    import torch.distributed as dist

    from workbench.workers.updates import mean_over_ranks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mine = {"a/loss": [1.0, 3.0][rank], "a/x_max": [5.0, 2.0][rank], "a/x_min": [float("inf"), 0.5][rank]}
        out = mean_over_ranks(mine)
        assert list(out) == list(mine)
        assert out == {"a/loss": 2.0, "a/x_max": 5.0, "a/x_min": 0.5}
        assert mean_over_ranks({"b_min": float("inf")}) == {"b_min": 0.0}  # no rank had a token
    finally:
        dist.destroy_process_group()
