"""The pre-RL stages on the arithmetic task: SFT learns the answers, the Bradley–Terry reward
model ranks correct answers above wrong ones on problems it never saw.

Learned quantities, so their thresholds are margins below what 3 SFT seeds x 2 reward-model seeds
gave under each of the two numerical configurations (`make test-numerics`): SFT's loss ratio
(mean of the last 20 steps over the first 5) 0.009-0.06, against < 0.2; the reward model's
held-out pairwise accuracy 0.74-0.92 (0.87 and 0.92 for the seeds below), against >= 0.65
(chance: 0.5). A threshold of 0.9 on one seed failed on another CPU."""

import random

import pytest
import torch

from workbench.data import arithmetic
from workbench.models import make_tiny
from workbench.models.value import load_value_model
from workbench.stages import StageConfig, encode_examples, pairwise_accuracy, train_reward_model, train_sft

pytestmark = pytest.mark.numerics  # what a model computes or learns: `make test-numerics` reruns it


@pytest.fixture(scope="module")
def problems():
    """All 100 one-digit additions, split 70 / 30 by problem (held-out problems are unseen)."""
    every = {p.prompt: p for p in arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), 2000, seed=0)}
    keys = sorted(every)
    random.Random(0).shuffle(keys)
    return [every[k] for k in keys[:70]], [every[k] for k in keys[70:]]


@pytest.fixture(scope="module")
def sft_result(problems, tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("stages")
    train, _ = problems
    return train_sft(
        make_tiny("1m", d / "base"),
        arithmetic.demonstrations(train * 6),
        d / "sft",
        StageConfig(steps=300, log_every=0),
    )


def test_sft_lowers_the_loss(sft_result):
    # Means, not single steps: one step's loss is one random batch's.
    losses = sft_result["losses"]
    first, last = sum(losses[:5]) / 5, sum(losses[-20:]) / 20
    assert last < 0.2 * first, (first, last)


def test_reward_model_ranks_unseen_correct_answers_first(sft_result, problems, tmp_path):
    train, held_out = problems
    pairs = arithmetic.preference_pairs(train * 6, 2, seed=0)
    result = train_reward_model(
        sft_result["path"], pairs, tmp_path / "rm", StageConfig(steps=300, lr=1e-3, seed=1, log_every=0)
    )
    loaded = load_value_model(result["path"])
    accuracy = pairwise_accuracy(loaded.model, loaded.tokenizer, arithmetic.preference_pairs(held_out, 4, seed=5))
    assert accuracy >= 0.65, f"held-out pairwise accuracy {accuracy:.2f}"


def test_encoding_masks_only_the_response_and_refuses_overlong(sft_result):
    from workbench.models import load

    tokenizer = load(sft_result["path"]).tokenizer
    ids, attention, loss_mask = encode_examples(tokenizer, ["Q: 1+2=? A:"], [" 3"], max_length=32)
    prompt_len = len(tokenizer("Q: 1+2=? A:").input_ids)
    assert loss_mask[0, :prompt_len].sum() == 0 and loss_mask[0, prompt_len:].sum() == attention[0].sum() - prompt_len
    with pytest.raises(ValueError, match="longer than max_length=4"):
        encode_examples(tokenizer, ["Q: 1+2=? A:"], [" 3"], max_length=4)
