"""`Workload.frozen_keep="auto"`: the auto-mapper and the search plan with each way of keeping
frozen models and return the fastest plan that fits, naming the keep they chose."""

import dataclasses

import pytest

from workbench import Mesh
from workbench.deploy import deploy_plan
from workbench.planner import PlannerError, Problem, Simulator, Workload, automap, cluster_preset, dataflow_preset
from workbench.planner.automap import automap_async
from workbench.planner.memory import static_memory
from workbench.planner.search import search

PPO = dataflow_preset("ppo")


def keeps(model: str, devices: int) -> dict:
    """Each keep's plan time (None where no plan fits) and the "auto" plan."""
    cluster = cluster_preset("a100_80g", devices)
    times = {}
    for keep in ("whole", "sharded", "host"):
        try:
            times[keep] = automap(Problem(PPO, model, Workload(frozen_keep=keep), cluster)).iteration_time
        except PlannerError:
            times[keep] = None
    return times, automap(Problem(PPO, model, Workload(frozen_keep="auto"), cluster))


def test_host_memory_makes_a_placement_fit_that_no_device_keep_does():
    # PPO's four 34B models on 16 A100s: no placement fits while the frozen two hold device memory;
    # in host memory they leave the devices to the trained two.
    times, auto = keeps("llama2-34b", 16)
    assert times["whole"] is None and times["sharded"] is None and times["host"] is not None
    assert auto.workload.frozen_keep == "host" and auto.iteration_time == pytest.approx(times["host"])


def test_the_fastest_keep_wins_and_a_tie_keeps_the_weights_whole():
    times, auto = keeps("llama2-70b", 64)  # sharded frees memory for generation: faster than whole
    best = min((t, i, k) for i, (k, t) in enumerate(times.items()) if t is not None)[2]
    assert times["sharded"] < times["whole"]
    assert auto.workload.frozen_keep == best and auto.iteration_time == pytest.approx(times[best])
    times, auto = keeps("llama2-13b", 16)  # the frozen models fit either way: nothing to gain
    assert len(set(times.values())) == 1 and auto.workload.frozen_keep == "whole"


def test_where_no_keep_fits_the_whole_keeps_refusal_is_raised():
    with pytest.raises(PlannerError, match="no placement fits"):
        automap(Problem(PPO, "llama2-70b", Workload(frozen_keep="auto"), cluster_preset("a100_80g", 32)))


def test_the_search_chooses_a_keep_too():
    cluster = cluster_preset("a100_80g", 16)
    fast = dict(max_steps=40, seeds=(0,))
    result = search(Problem(PPO, "llama2-34b", Workload(frozen_keep="auto"), cluster), **fast)
    assert result.workload.frozen_keep == "host" and not result.evaluation.oom  # the only keep that fits, as above
    assert search(Problem(PPO, "llama2-34b", Workload(frozen_keep="whole"), cluster), **fast).evaluation.oom


def test_a_simulator_prices_one_keep_not_a_choice():
    with pytest.raises(PlannerError, match="frozen_keep='auto' is a choice automap and search make"):
        Simulator(cluster_preset("a100_80g", 8), Workload(frozen_keep="auto"))
    with pytest.raises(ValueError, match="frozen_keep='auto' is a choice"):  # the memory model on its own
        static_memory(PPO.model_specs("llama2-7b")["reference"], Mesh(1, 1, 8), False, "full", "auto")
    # The asynchronous auto-mapper chooses too.
    split = automap_async(Problem(PPO, "llama2-34b", Workload(frozen_keep="auto"), cluster_preset("a100_80g", 24)))
    assert split.workload.frozen_keep in ("whole", "sharded", "host")


def test_deploying_a_plan_refuses_frozen_models_that_keep_more_than_it_counted():
    from workbench import ActorConfig, ActorRolloutRefWorker, RewardModelWorker, ScoreModelConfig
    from workbench.deploy.plans import check_frozen_keeps

    plan = automap(Problem(PPO, "llama2-34b", Workload(frozen_keep="auto"), cluster_preset("a100_80g", 16)))
    reference = ActorConfig("m", train=False, rollout=None, reference=True)
    workers = {
        "actor": (ActorRolloutRefWorker, ActorConfig("m")),
        "reference": (ActorRolloutRefWorker, reference),
        "critic": (object, None),
        "reward": (RewardModelWorker, ScoreModelConfig("m", keep="host")),
    }
    with pytest.raises(PlannerError, match=r"reference: ActorConfig.reference_keep='whole' keeps more .*'host'"):
        deploy_plan(plan, None, workers)  # refused before the session is touched
    workers["reference"] = (ActorRolloutRefWorker, dataclasses.replace(reference, reference_keep="host"))
    check_frozen_keeps("host", workers)
    check_frozen_keeps("whole", workers)  # keeping less than counted is fine
    whole_reward = {**workers, "reward": (RewardModelWorker, ScoreModelConfig("m", keep="whole"))}
    with pytest.raises(PlannerError, match=r"reward: ScoreModelConfig.keep='whole' keeps .*keep='sharded'"):
        check_frozen_keeps("sharded", whole_reward)
