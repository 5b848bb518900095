"""The batch inspector on multi-turn rows: observation tokens are shown between the policy's
turns, grey and valueless (not trained on); single-turn rows look as before."""

import torch

from widgets.inspector import OBSERVED, BatchInspector
from workbench.data.batch import Batch


def episodes() -> Batch:
    # Row 0: policy 2 tokens, observation 2, policy 1, padding 1. Row 1: a single turn of 3.
    responses = torch.tensor([[11, 12, 90, 91, 13, 0], [21, 22, 23, 0, 0, 0]])
    policy = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]])
    attended = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    prompt = torch.tensor([[5, 6], [5, 6]])
    return Batch(
        {
            "input_ids": torch.cat([prompt, responses], 1),
            "attention_mask": torch.cat([torch.ones(2, 2, dtype=torch.long), attended], 1),
            "responses": responses,
            "response_mask": policy,
            "old_log_probs": -torch.arange(12, dtype=torch.float).reshape(2, 6) * policy,
            "scores": torch.tensor([1.0, 0.0]),
        },
        {"prompt": ["q0", "q1"], "response_text": ["a", "b"]},
    )


def test_observation_tokens_show_between_turns_grey_and_untrained():
    inspector = BatchInspector(episodes(), field="log-prob", sort="none")
    first, second = inspector.tokens(0), inspector.tokens(1)
    assert [t["text"] for t in first] == ["11", "12", "90", "91", "13"]  # padding left out
    assert [t["trained"] for t in first] == [True, True, False, False, True]
    assert [t["value"] for t in first] == [-0.0, -1.0, None, None, -4.0]
    assert [t["colour"] == OBSERVED for t in first] == [False, False, True, True, False]
    assert [t["trained"] for t in second] == [True, True, True]
    html = inspector.summary()
    assert html.count("observation: not trained") == 2


def test_a_fresh_rollouts_episodes_show_their_rollout_log_probs_and_rewards():
    whole = episodes()
    batch = whole.select(*(k for k in whole.keys() if k not in ("old_log_probs", "scores")))
    batch["rollout_log_probs"], batch["episode_reward"] = whole["old_log_probs"], whole["scores"]
    inspector = BatchInspector(batch, field="log-prob", sort="none")
    assert [t["value"] for t in inspector.tokens(0)] == [-0.0, -1.0, None, None, -4.0]
    assert [r["score"] for r in inspector.rows()] == [1.0, 0.0]


def test_a_row_reads_with_its_mask_drawn_in():
    inspector = BatchInspector(episodes(), field="log-prob", sort="none")
    assert inspector.marked(0) == "1112⟦9091⟧13" and inspector.marked(1) == "212223"
    assert inspector.marked(0, ("[", "]")) == "1112[9091]13"
