"""The auto-mapper's d_cost and the search's TimeCost price the same plan the same way, except
where the docstring of `AutoMapper.level_times` says they differ on purpose."""

import dataclasses

import pytest

from workbench.planner import Problem, Workload, cluster_preset, dataflow_preset
from workbench.planner.automap import AutoMapper
from workbench.planner.execution import PlanEvaluator

# A CPU machine whose four logical devices share two cores, with a slow driver: the terms a
# calibrated local cluster has and the GPU presets do not.
SHARED_CPU = dataclasses.replace(cluster_preset("local", 4), cores_per_node=2.0, driver_bandwidth=2e7)
TINY_FULL = dataclasses.replace(Workload.tiny(), param_sharding="full")
CASES = [
    ("ppo", "llama2-7b", cluster_preset("a100_80g", 16), Workload()),
    ("grpo", "llama2-7b", cluster_preset("h100", 8), Workload()),
    ("ppo", "tiny-10m", SHARED_CPU, TINY_FULL),
    ("grpo", "tiny-10m", SHARED_CPU, TINY_FULL),
]


def _both(flow_name, model, cluster, wl):
    """(automap estimate, TimeCost of the same plan over one iteration) for the colocated and
    the actor-apart placements."""
    flow = dataflow_preset(flow_name)
    problem = Problem(flow, model, wl, cluster)
    mapper = AutoMapper(problem)
    evaluator = PlanEvaluator(problem, n_iterations=1)
    models = flow.models
    out = []
    for placement in [(tuple(models),), ((models[0],), tuple(models[1:]))]:
        plan = mapper.run([placement])
        out.append((plan.iteration_time, evaluator.evaluate(plan.to_execution_plan()).time, len(flow.calls)))
    return out


@pytest.mark.parametrize(("flow_name", "model", "cluster", "wl"), CASES, ids=lambda x: getattr(x, "name", None))
def test_automap_and_timecost_agree_on_the_same_plan(flow_name, model, cluster, wl):
    for automap_s, timecost_s, _ in _both(flow_name, model, cluster, wl):
        # Only the data moved between sets (well under a millisecond here) is left out of d_cost.
        assert timecost_s == pytest.approx(automap_s, rel=1e-3)


def test_shared_cores_slow_the_auto_mappers_plans_as_they_slow_timecosts():
    alone = dataclasses.replace(SHARED_CPU, cores_per_node=None)
    (colocated_shared, _, _), _ = _both("ppo", "tiny-10m", SHARED_CPU, TINY_FULL)
    (colocated_alone, _, _), _ = _both("ppo", "tiny-10m", alone, TINY_FULL)
    # Four devices on two cores: every call of the colocated plan runs at half speed.
    assert colocated_shared == pytest.approx(2 * colocated_alone, rel=0.01)


def test_dispatch_overhead_is_where_the_two_differ_by_design():
    # The auto-mapper charges each call's dispatch in series with the call; TimeCost issues it
    # as a task of its own that overlaps the call running before it on the same devices.
    overhead = 0.01
    cluster = dataclasses.replace(SHARED_CPU, call_overhead=overhead)
    for automap_s, timecost_s, n_calls in _both("ppo", "tiny-10m", cluster, TINY_FULL):
        assert 0 < automap_s - timecost_s <= n_calls * overhead + 1e-9
