"""The table of an iteration's steps (workbench/steps.py) is what the algorithms run, what the
planner plans, what the NaN guard names and what the clock tags; no Ray."""

import math
from types import SimpleNamespace

import pytest
import torch

import algorithms
from algorithms.guard import finite_batch
from workbench import steps
from workbench.data.batch import Batch
from workbench.errors import NonFiniteError
from workbench.planner import dataflow_preset
from workbench.workers.actor import ActorRolloutRefWorker
from workbench.workers.critic import CriticWorker
from workbench.workers.reward import CostModelWorker, RewardModelWorker

WORKER_OF_ROLE = {
    "actor": ActorRolloutRefWorker,
    "reference": ActorRolloutRefWorker,
    "critic": CriticWorker,
    "cost_critic": CriticWorker,
    "reward": RewardModelWorker,
    "cost": CostModelWorker,
}


def test_each_row_names_a_real_algorithm_method_and_worker_method():
    assert len(steps.BY_NAME) == len(steps.STEPS)  # one row per name
    classes = [algorithms.Algorithm, *algorithms.ALGORITHMS.values()]
    for step in steps.STEPS:
        assert any(callable(getattr(c, step.algorithm_method, None)) for c in classes), step
        if step.kind == "driver":
            assert step.role == steps.DRIVER and step.worker_method is None
        else:
            assert callable(getattr(WORKER_OF_ROLE[step.role], step.worker_method)), step
    assert steps.default_step("generate") is steps.GEN and steps.default_step("update_critic") is steps.UPDATE_CRITIC
    assert "update_cost_critic" in steps.table() and steps.get("adv").kind == "driver"
    with pytest.raises(KeyError, match="the steps are"):
        steps.get("actor_gen")


@pytest.mark.parametrize("name", sorted(algorithms.ALGORITHMS))
def test_the_planner_calls_are_the_table_s_steps(name):
    for call in dataflow_preset(name).calls:
        row = steps.get(call.name)
        assert (call.model, call.kind) == (row.role, row.kind), call


def test_verl_metric_names_stay():
    assert {"gen", "old_log_prob", "ref", "values", "reward", "adv", "update_critic", "update_actor"} <= set(
        steps.BY_NAME
    )


def test_the_guard_names_the_step_that_made_a_bad_field():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    batch = Batch(
        {
            "response_mask": mask,
            "scores": torch.tensor([1.0, 2.0]),
            "advantages": torch.tensor([[0.1, 0.2, math.nan], [0.3, math.inf, math.nan]]),
        },
        {"uid": ["a", "b"]},
    )
    finite_batch(batch, before="update_actor")  # NaN/inf only in padding: nothing read is bad
    batch["values"] = torch.tensor([[0.0, math.nan, 0.0], [0.0, 0.0, 0.0]])
    batch["scores"] = torch.tensor([1.0, math.inf])
    with pytest.raises(NonFiniteError, match=r"'values' \(made by the 'values' step\) in 1 row\(s\), uid a") as info:
        finite_batch(batch, before="update_critic")  # values are made before the scores
    assert info.value.step == "values"
    # Every field the old guard checked, named with the same step.
    old = {
        "scores": "reward",
        "token_level_scores": "reward",
        "costs": "cost",
        "token_level_costs": "cost",
        "token_level_rewards": "reward_shaping",
        "token_level_kl": "reward_shaping",
        "values": "values",
        "cost_values": "cost_values",
        "old_log_probs": "old_log_prob",
        "rollout_log_probs": "gen",
        "ref_log_probs": "ref",
        "advantages": "adv",
        "returns": "adv",
        "cost_advantages": "adv",
        "cost_returns": "adv",
    }
    assert {field: steps.producer_of(field) for field in old} == old


class _Actor:
    """Returns a finished, empty future at once and remembers its trace tags."""

    def __init__(self):
        self.tags = []

    def generate_sequences(self, prompts, sampling):
        future = SimpleNamespace(metas=None, outputs=[], trace_tags={})
        self.tags.append(future.trace_tags)
        return future


def test_an_iteration_starts_where_generate_is_told_so():
    actor = _Actor()
    grpo = algorithms.GRPO(algorithms.Groups(actor=actor, reward=object()), algorithms.GRPOConfig(kl_loss_coef=0.0))
    prompts = Batch({"input_ids": torch.ones(2, 3, dtype=torch.long)})
    grpo.generate(prompts)
    grpo.clock.seconds["earlier"] = 1.0
    grpo.generate(prompts, step="gen_greedy", new_iteration=False)  # ReMax's second generation
    assert set(grpo.clock.seconds) == {"gen", "gen_greedy", "earlier"}
    assert [t["step"] for t in actor.tags] == ["gen", "gen_greedy"]
    grpo.generate(prompts)
    assert set(grpo.clock.seconds) == {"gen"}  # a new iteration: the clock started again
    assert actor.tags[-1]["step"] == "gen"
