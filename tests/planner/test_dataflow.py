import pytest

from workbench.planner import Call, Dataflow, dataflow_preset, model_preset


def test_ppo_has_three_levels_over_four_models():
    ppo = dataflow_preset("ppo")
    assert set(ppo.models) == {"actor", "critic", "reference", "reward"}
    level = ppo.levels()
    assert level["gen"] == 0 and level["reward"] == 1 and level["update_actor"] == 2
    assert ppo.n_levels == 3
    assert ppo.trained("critic") and not ppo.trained("reference") and ppo.generates("actor")


@pytest.mark.parametrize(
    "name,models,levels", [("grpo", 3, 3), ("remax", 3, 3), ("rloo", 3, 3), ("reinforce_pp", 3, 3), ("safe_rlhf", 6, 4)]
)
def test_other_presets(name, models, levels):
    flow = dataflow_preset(name)
    assert len(flow.models) == models
    assert flow.n_levels == levels  # Safe-RLHF's PPO-ptx step follows the RL update


def test_value_models_get_a_scalar_head():
    specs = dataflow_preset("ppo").model_specs("llama2-7b")
    assert specs["critic"].value_head and not specs["actor"].value_head
    specs = dataflow_preset("ppo").model_specs(
        {"actor": "llama2-13b", "critic": "llama2-7b", "reference": "llama2-13b", "reward": model_preset("llama2-7b")}
    )
    assert specs["actor"].name == "llama2-13b" and specs["reward"].value_head


def test_dependencies_must_come_first():
    with pytest.raises(ValueError, match="must be listed before"):
        Dataflow("bad", (Call("b", "m", "train", ("a",)), Call("a", "m", "generate")))


def test_with_rollout_moves_generation_to_a_frozen_role_of_its_own():
    ppo = dataflow_preset("ppo")
    split = ppo.with_rollout()
    assert [c.name for c in split.calls] == [c.name for c in ppo.calls]
    assert split.calls_of("rollout") == (Call("gen", "rollout", "generate"),)
    assert split.generates("rollout") and not split.trained("rollout")
    assert not split.generates("actor") and split.trained("actor")
    assert split.levels() == ppo.levels()
    with pytest.raises(ValueError, match="already has a role 'actor'"):
        ppo.with_rollout("actor")
