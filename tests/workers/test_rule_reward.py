"""Rule rewards run as Ray tasks, fed by Batches or by another group's future."""

import math
import time

import pytest
import torch

from tests.controller.workers import EchoWorker
from workbench import Batch, DispatchError, WorkerCallError
from workbench.data import arithmetic
from workbench.workers.rule_reward import RuleReward


def answers(texts, truths):
    return Batch({"x": torch.arange(len(texts), dtype=torch.float32)},
                 {"response_text": texts, "ground_truth": truths, "uid": [f"u{i}" for i in range(len(texts))]})


def test_scores_batches_in_chunks(shared_session):
    batch = answers([" 12", " 7</s>", "13", " 85 and more"], ["12", "8", "13", "85"])
    scores = RuleReward(arithmetic.score, chunk_size=3).compute_reward(batch).get()
    assert scores["scores"].tolist() == [1.0, 0.0, 1.0, 1.0]


def test_takes_another_groups_future_and_drops_its_padding(session):
    group = session.group("g", EchoWorker, session.pool("two", 2))
    batch = answers([" 1", " 2", " 3"], ["1", "0", "3"])
    future = group.double(batch)  # 3 rows on 2 ranks: padded to 4 inside the group
    with_text = RuleReward(lambda text, truth: float(text.strip() == truth), text_key="uid", truth_key="uid")
    assert with_text.compute_reward(future).get()["scores"].tolist() == [1.0, 1.0, 1.0]


def test_errors_name_the_function_and_row(shared_session):
    def explodes(text, truth):
        if text == "bad":
            raise ValueError("cannot parse")
        return 1.0

    with pytest.raises(WorkerCallError, match=r"explodes raised on row uid=u1 .*cannot parse"):
        RuleReward(explodes).compute_reward(answers(["ok", "bad"], ["1", "1"])).get()
    with pytest.raises(WorkerCallError, match=r"returned nan on row uid=u0"):
        RuleReward(lambda t, g: math.nan).compute_reward(answers(["x"], ["1"])).get()
    with pytest.raises(DispatchError, match=r"no column\(s\) \['response_text'\]"):
        RuleReward(arithmetic.score).compute_reward(Batch({"x": torch.zeros(2)}, {"ground_truth": ["1", "2"]}))


def test_a_hanging_function_times_out(shared_session):
    def hangs(text, truth):
        time.sleep(60)
        return 0.0

    start = time.monotonic()
    with pytest.raises(WorkerCallError, match=r"took more than 1.0 s"):
        RuleReward(hangs, timeout=1.0).compute_reward(answers(["x"], ["1"])).get()
    assert time.monotonic() - start < 20
