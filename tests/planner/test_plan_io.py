"""A model-level Plan as YAML values and back (plan_io): round trips of auto-mapped plans, a
hand-written plan priced as automap prices its own, and every refusal naming its field."""

import pytest
import yaml

from workbench.planner import (
    PlanFormatError,
    Problem,
    Workload,
    automap,
    cluster_preset,
    dataflow_preset,
    plan_from_dict,
    plan_to_dict,
)

PPO = dataflow_preset("ppo")
WL = Workload.tiny()
LOCAL4 = cluster_preset("local", 4)
SPECS = PPO.model_specs("tiny-1m")


def one_each(**overrides):
    """actor+reference on devices 0-1 (dp 2), critic and reward on 2-3."""
    return {
        "sets": [
            {
                "devices": 2,
                "models": {
                    "actor": {"pp": 1, "tp": 1, "dp": 2, "generation": {"pp": 1, "tp": 1, "dp": 2}},
                    "reference": {"pp": 1, "tp": 1, "dp": 2},
                },
            },
            {"devices": 2, "models": {"critic": {"dp": 2}, "reward": {"pp": 1, "tp": 2, "dp": 1}}},
        ],
        **overrides,
    }


@pytest.mark.parametrize(
    "flow, model, cluster",
    [
        (PPO, "tiny-1m", LOCAL4),
        (dataflow_preset("grpo"), "tiny-10m", cluster_preset("local", 2)),
        (PPO, "llama2-7b", cluster_preset("a100_80g", 16)),
    ],
)
def test_round_trip_of_automapped_plans(flow, model, cluster):
    plan = automap(Problem(flow, model, WL if model.startswith("tiny") else Workload(), cluster))
    values = plan.to_dict("p")
    back = plan_from_dict(yaml.safe_load(yaml.safe_dump(values)), flow, flow.model_specs(model), plan.workload, cluster)
    assert back.to_dict("p") == values
    assert [(s.models, s.first_device, s.n_devices, s.devices_per_node) for s in back.sets] == [
        (s.models, s.first_device, s.n_devices, s.devices_per_node) for s in plan.sets
    ]
    assert back.call_times == pytest.approx(plan.call_times)
    assert back.iteration_time == pytest.approx(plan.iteration_time)


def test_hand_written_plan_is_priced_and_packed():
    plan = plan_from_dict(one_each(), PPO, SPECS, WL, LOCAL4)
    assert [(s.name, s.first_device, s.n_devices) for s in plan.sets] == [
        ("actor+reference", 0, 2),
        ("critic+reward", 2, 2),
    ]
    assert plan.set_of("reward").assignments["reward"].strategy.tp == 2
    assert plan.set_of("critic").assignments["critic"].strategy.dp == 2  # pp, tp default to 1, dp to the rest
    assert set(plan.call_times) == {c.name for c in PPO.calls}
    assert plan.iteration_time == pytest.approx(sum(plan.level_times)) and plan.iteration_time > 0
    assert plan.stats["source"] == "hand-written"
    again = plan_to_dict(plan)
    assert again["sets"][1]["first_device"] == 2 and again["estimated_iteration_s"] == round(plan.iteration_time, 6)


def test_a_generation_layout_is_priced():
    values = {"sets": [{"devices": 4, "models": {m: {"tp": 2, "dp": 2} for m in PPO.models}}]}
    values["sets"][0]["models"]["actor"]["generation"] = {"tp": 1, "dp": 4}
    plan = plan_from_dict(values, PPO, SPECS, WL, LOCAL4)
    actor = plan.set_of("actor").assignments["actor"]
    assert actor.generation.short() == "p1t1d4" and actor.transition is not None


def test_the_actor_without_a_generation_layout_generates_in_its_own():
    values = one_each()
    del values["sets"][0]["models"]["actor"]["generation"]
    plan = plan_from_dict(values, PPO, SPECS, WL, LOCAL4)
    assert plan.set_of("actor").assignments["actor"].generation.short() == "p1t1d2"


def refusal(values, cluster=LOCAL4, flow=PPO):
    with pytest.raises(PlanFormatError) as info:
        plan_from_dict(values, flow, flow.model_specs("tiny-1m"), WL, cluster)
    return info.value


def edit(change):
    values = one_each()
    change(values)
    return values


@pytest.mark.parametrize(
    "values, where, words",
    [
        ("automap", "plan", "mapping"),
        ({"sets": []}, "plan.sets", "list of colocated sets"),
        ({"sets": [], "placement": 1}, "plan.placement", "not a field"),
        (edit(lambda v: v["sets"][0].pop("devices")), "plan.sets[0].devices", "device count"),
        (edit(lambda v: v["sets"][0].update(devices=0)), "plan.sets[0].devices", ">= 1"),
        (edit(lambda v: v["sets"][1].update(devices=3)), "plan.sets[1].devices", "beyond the 4 device"),
        (edit(lambda v: v["sets"][1].update(first_device=1)), "plan.sets[1].first_device", "share devices"),
        (edit(lambda v: v["sets"][1].update(colour="red")), "plan.sets[1].colour", "not a field"),
        (edit(lambda v: v["sets"][1].update(models={})), "plan.sets[1].models", "model -> {pp, tp, dp}"),
        (edit(lambda v: v["sets"][1]["models"].pop("reward")), "plan.sets", "needs ['reward']"),
        (edit(lambda v: v["sets"][1]["models"].update(rollout={})), "plan.sets[1].models.rollout", "no model"),
        (edit(lambda v: v["sets"][1]["models"].update(actor={})), "plan.sets[1].models.actor", "already placed"),
        (edit(lambda v: v["sets"][1]["models"].update(critic={"dp": 4})), "plan.sets[1].models.critic", "pp*tp*dp"),
        (edit(lambda v: v["sets"][1]["models"].update(critic={"tp": 1.5})), "plan.sets[1].models.critic.tp", "whole"),
        (
            {
                "sets": [
                    {"devices": 1, "models": {"actor": {}, "reference": {}}},
                    {"devices": 3, "models": {"critic": {"pp": 3}, "reward": {}}},
                ]
            },
            "plan.sets[1].models.critic.pp",
            "4 layers",
        ),
        (edit(lambda v: v["sets"][1]["models"].update(critic=[1, 1, 2])), "plan.sets[1].models.critic", "mapping"),
        (edit(lambda v: v["sets"][1]["models"].update(critic={"dp": 2, "mesh": 1})), "critic.mesh", "not a field"),
        (
            edit(lambda v: v["sets"][1]["models"].update(critic={"dp": 2, "generation": {"dp": 2}})),
            "plan.sets[1].models.critic.generation",
            "only the actor",
        ),
        (
            edit(lambda v: v["sets"][0]["models"]["actor"].update(generation={"tp": 2, "dp": 1})),
            "plan.sets[0].models.actor.generation",
            "tp divides 1",
        ),
    ],
)
def test_refusals_name_the_field(values, where, words):
    error = refusal(values)
    assert error.where.endswith(where) and words in error.fix, str(error)


def test_tensor_parallelism_stays_in_a_machine_and_divides_the_heads():
    two_per_node = cluster_preset("local", 2)  # one machine of 2 devices
    values = {"sets": [{"devices": 2, "models": {m: {"dp": 2} for m in PPO.models}}]}
    values["sets"][0]["models"]["critic"] = {"tp": 2, "dp": 1}
    assert plan_from_dict(values, PPO, SPECS, WL, two_per_node).set_of("critic").assignments["critic"].strategy.tp == 2
    spec3 = {
        **SPECS,
        "critic": SPECS["critic"].__class__(**{**SPECS["critic"].__dict__, "n_heads": 3, "n_kv_heads": 3}),
    }
    with pytest.raises(PlanFormatError, match="divide the model's 3 heads"):
        plan_from_dict(values, PPO, spec3, WL, two_per_node)


def test_a_set_that_does_not_fit_is_refused():
    small = cluster_preset("a100_80g", 8)
    flow = PPO
    values = {"sets": [{"devices": 1, "models": {m: {"dp": 1} for m in flow.models}}]}
    with pytest.raises(PlanFormatError) as info:
        plan_from_dict(values, flow, flow.model_specs("llama2-70b"), Workload(), small)
    assert "GiB" in info.value.fix and info.value.where.startswith("plan.sets[0]")
