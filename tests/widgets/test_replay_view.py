"""algorithms.replay's result and widgets.ReplayView on numbers whose answers are known: three
update directions with chosen dot products, advantages with padding that must not show. (Replay
on real worker groups: tests/run/test_checkpoint.py, tests/workers/test_lora.py and
tests/workers/test_pipeline_workers.py.)"""

import math

import pytest
import torch

from algorithms.grpo import GRPOConfig
from algorithms.replay import ReplayResult, variant_rows
from widgets import ReplayView
from workbench.data.batch import Batch

DIRECTIONS = {"a": [1.0, 0.0], "b": [2.0, 0.0], "c": [1.0, 1.0]}


def known_result() -> ReplayResult:
    names = list(DIRECTIONS)
    vectors = [torch.tensor(DIRECTIONS[n], dtype=torch.float64) for n in names]
    dots = [[float(u @ v) for v in vectors] for u in vectors]
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    advantages = {n: torch.tensor([[1.0, 1.0, 0.0], [-0.5, -0.5, -0.5]]) * (i + 1) for i, n in enumerate(names)}
    metrics = {
        n: {"actor/pg_loss": 0.1 * i, "actor/grad_norm": 1.0 + i, "replay/update_norm": math.sqrt(dots[i][i])}
        for i, n in enumerate(names)
    }
    return ReplayResult(
        {"a": {}, "b": {"estimator": "drgrpo"}, "c": {"policy_loss": "gspo"}}, metrics, advantages, mask, dots
    )


def test_cosines_and_the_table():
    result = known_result()
    cos = result.cosines()
    assert cos["a"]["a"] == cos["a"]["b"] == 1.0  # b is a scaled: the same direction
    assert cos["a"]["c"] == pytest.approx(1 / math.sqrt(2)) and cos["c"]["a"] == cos["a"]["c"]
    table = result.table()
    assert [r["variant"] for r in table] == ["a", "b", "c"]
    assert table[0]["changes"] == "live config" and table[1]["changes"] == "estimator=drgrpo"
    assert [r["grad norm"] for r in table] == [1.0, 2.0, 3.0] and "clip fraction" not in table[0]  # none has it
    assert "estimator=drgrpo" in repr(result)


def test_the_view_shows_the_table_the_cosines_and_one_sample_s_advantages():
    view = ReplayView(known_result())
    data = view.data()
    assert data["cosines"]["a"]["c"] == pytest.approx(1 / math.sqrt(2))
    assert data["advantages"] == {"a": [1.0, 1.0], "b": [2.0, 2.0], "c": [3.0, 3.0]}  # padding left out
    view.set(row=1)
    assert view.data()["advantages"]["c"] == [-1.5, -1.5, -1.5]
    assert "<td>estimator=drgrpo</td>" in view.summary()
    assert view.png().startswith(b"\x89PNG")
    layout, update = view.figure()
    update()
    with pytest.raises(ValueError, match=r"row 2 is not a sample of the batch; use 0..1"):
        view.set(row=2)
    with pytest.raises(ValueError, match="ReplayView shows what algo.replay"):
        ReplayView({"a": 1})


def test_a_variant_s_rows_carry_its_own_advantages_and_leave_the_batch_alone():
    uid = ["p0", "p0", "p1", "p1"]
    scores = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 3.0], [0.0, 1.0]])
    batch = Batch(
        {"token_level_rewards": scores, "token_level_scores": scores, "response_mask": torch.ones(4, 2)}, {"uid": uid}
    )
    grpo = variant_rows(batch, {}, GRPOConfig())
    dr = variant_rows(batch, {"estimator": "drgrpo"}, GRPOConfig(estimator="drgrpo"))
    assert "advantages" not in batch  # a copy
    # GRPO divides by the group's std, Dr. GRPO does not: 1 vs 0 and 3 vs 1 give +-0.71 and +-1.
    assert grpo["advantages"][:, 0].tolist() == pytest.approx([0.7071, -0.7071, 0.7071, -0.7071], abs=1e-3)
    assert dr["advantages"][:, 0].tolist() == pytest.approx([0.5, -0.5, 1.0, -1.0])
