"""algorithms.mismatch and widgets.MismatchView on a batch whose gaps are known: three tokens
off by chosen amounts, the rest agreeing, padding that must not count. (The view on a real
run's batch: tests/widgets/test_live_views.py.)"""

import math

import pytest
import torch

from algorithms.metrics import data_metrics
from algorithms.mismatch import mismatch
from widgets.mismatch import MismatchView
from workbench.data.batch import Batch

OFF = {(0, 1): 0.7, (1, 0): -2.0, (2, 2): 0.05}
"""(row, position) -> rollout - trainer; every other response token agrees exactly."""


def known_batch(noise: float = 0.0) -> Batch:
    torch.manual_seed(0)
    trainer = -torch.rand(3, 4) * 3
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    rollout = trainer + noise * torch.randn(3, 4)
    for (row, pos), gap in OFF.items():
        rollout[row, pos] = trainer[row, pos] + gap
    rollout[0, 3] = trainer[0, 3] + 9.0  # padding: never counted
    tensors = {
        "old_log_probs": trainer,
        "rollout_log_probs": rollout,
        "response_mask": mask,
        "responses": torch.arange(12).reshape(3, 4),
        "attention_mask": torch.ones(3, 6, dtype=torch.long),
        "token_level_scores": torch.zeros(3, 4),
    }
    return Batch(tensors, {"prompt": ["a", "b", "c"]})


def test_the_numbers_are_the_metrics_and_the_known_gaps():
    batch = known_batch()
    m = mismatch(batch, iteration=1)
    assert m.mean_abs() == data_metrics(batch)["actor/rollout_logprob_diff"]
    assert m.mean_abs() == pytest.approx((0.7 + 2.0 + 0.05) / 9)  # nine response tokens
    worst = m.worst(3)
    assert [(w["row"], w["position"]) for w in worst] == [(1, 0), (0, 1), (2, 2)]
    assert [w["diff"] for w in worst] == pytest.approx([-2.0, 0.7, 0.05], abs=1e-6)
    assert worst[0]["ratio"] == pytest.approx(math.exp(2.0), rel=1e-5) and worst[0]["token"] == 4
    assert m.quantiles((0.5, 1.0)) == pytest.approx({0.5: 0.0, 1.0: 2.0}, abs=1e-6)
    edges, counts = m.histogram()
    assert sum(counts) == 9 and counts[0] == 6  # exact agreement falls in the first bin

    [cap] = m.caps((2.0,))  # only the row-1 token's ratio (e^2) is over 2
    assert cap["over"] == pytest.approx(1 / 9)
    ratios = [math.exp(-0.7), math.exp(2.0), math.exp(-0.05)] + [1.0] * 6
    assert cap["tis_mean_weight"] == pytest.approx(sum(min(r, 2.0) for r in ratios) / 9, rel=1e-5)
    assert cap["decoupled_kept"] == pytest.approx(8 / 9)


def test_the_view_follows_iterations_and_names_a_batch_without_a_trainer_forward():
    view = MismatchView(worst=2, keep=2)
    for it in (1, 2, 3):
        view(None, known_batch(noise=1e-3 * it), {"iteration": float(it)})
    assert [r["iteration"] for r in view.data()["per_iteration"]] == [1, 2, 3]
    assert sorted(view.held) == [2, 3]  # batches kept for the last two; every iteration's numbers stay
    assert view.data()["iteration"] == 3 and len(view.data()["worst"]) == 2
    view.set(iteration=2)
    assert view.data()["iteration"] == 2 and "iteration 2" in view.summary()
    with pytest.raises(ValueError, match=r"iteration 1 is not held; held: \[2, 3\]"):
        view.set(iteration=1)
    layout, update = view.figure()
    update()
    assert view.png().startswith(b"\x89PNG")

    same = known_batch()
    same["rollout_log_probs"] = same["old_log_probs"].clone()  # old_log_probs="rollout": no trainer forward
    view.add(same, 4)
    assert "run with old_log_probs='recompute'" in view.summary()
    rollout_only = Batch({k: same[k] for k in same.keys() if k != "old_log_probs"})
    with pytest.raises(ValueError, match=r"no \['old_log_probs'\] column"):
        mismatch(rollout_only)
