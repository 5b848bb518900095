"""Dataflows derived from the algorithm files match what their step() does."""

import pytest

import algorithms
from algorithms.base import Algorithm
from workbench.planner.derive import DeriveError, dataflow_preset, derive_dataflow


def edges(dataflow):
    return {(c.name, c.model, c.kind): set(c.deps) for c in dataflow.calls}


def test_ppo_is_the_hybridflow_graph():
    flow = derive_dataflow(algorithms.PPO, "ppo")
    assert flow.stages() == {"actor_gen": 0, "actor_logp": 1, "ref_logp": 1, "critic_values": 1, "reward": 1,
                             "critic_train": 2, "actor_train": 2}
    assert flow.value_models == ("critic", "reward")
    preparation = {"actor_logp", "ref_logp", "critic_values", "reward"}
    assert preparation <= set(flow.call("actor_train").deps) and preparation <= set(flow.call("critic_train").deps)
    assert dataflow_preset("PPO") == flow  # the planner's presets are these derived flows


def test_each_algorithm_has_its_own_shape():
    grpo = derive_dataflow(algorithms.GRPO)
    assert grpo.models == ("actor", "reference", "reward") and not grpo.trained("critic")
    remax = derive_dataflow(algorithms.ReMax)
    assert remax.call("actor_gen_greedy").kind == "generate"
    assert "reward_greedy" in remax.call("actor_train").deps  # the greedy baseline feeds the update
    safe = derive_dataflow(algorithms.SafeRLHF)
    assert {"cost", "cost_critic"} <= set(safe.models) and safe.trained("cost_critic")
    assert safe.call("ptx_train").deps == ("actor_train",)  # PPO-ptx follows the RL update
    assert safe.n_stages == 4


def test_a_step_without_stage_calls_is_refused():
    class Empty(Algorithm):
        def step(self, prompts):
            return prompts, {}

    with pytest.raises(DeriveError, match="makes no stage calls"):
        derive_dataflow(Empty)
