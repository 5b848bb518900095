"""Dataflows derived from the algorithm files match what their step() does."""

import pytest

import algorithms
from algorithms.base import Algorithm
from workbench.planner.derive import DeriveError, dataflow_preset, derive_dataflow


def edges(dataflow):
    return {(c.name, c.model, c.kind): set(c.deps) for c in dataflow.calls}


def test_ppo_is_the_hybridflow_graph():
    flow = derive_dataflow(algorithms.PPO, "ppo")
    assert flow.levels() == {
        "gen": 0,
        "old_log_prob": 1,
        "ref": 1,
        "values": 1,
        "reward": 1,
        "update_critic": 2,
        "update_actor": 2,
    }
    assert flow.value_models == ("critic", "reward")
    preparation = {"old_log_prob", "ref", "values", "reward"}
    assert preparation <= set(flow.call("update_actor").deps) and preparation <= set(flow.call("update_critic").deps)
    assert dataflow_preset("PPO") == flow  # the planner's presets are these derived flows


def test_each_algorithm_has_its_own_shape():
    grpo = derive_dataflow(algorithms.GRPO)
    assert grpo.models == ("actor", "reference", "reward") and not grpo.trained("critic")
    remax = derive_dataflow(algorithms.ReMax)
    assert remax.call("gen_greedy").kind == "generate"
    assert "reward_greedy" in remax.call("update_actor").deps  # the greedy baseline feeds the update
    safe = derive_dataflow(algorithms.SafeRLHF)
    assert {"cost", "cost_critic"} <= set(safe.models) and safe.trained("cost_critic")
    assert safe.call("update_ptx").deps == ("update_actor",)  # PPO-ptx follows the RL update
    assert safe.call("update_cost_critic").model == "cost_critic"
    assert safe.n_levels == 4


def test_a_step_without_step_calls_is_refused():
    class Empty(Algorithm):
        def step(self, prompts):
            return prompts, {}

    with pytest.raises(DeriveError, match="makes no step calls"):
        derive_dataflow(Empty)


@pytest.mark.parametrize("name", sorted(algorithms.ALGORITHMS))
def test_each_preset_read_off_its_file_is_the_class_derived_flow(name):
    """dataflow_preset reads algorithms/<file>.py without importing it; the same step() read
    through the live class gives the same dataflow."""
    assert dataflow_preset(name) == derive_dataflow(algorithms.ALGORITHMS[name], name)
