import math

import pytest

from workbench.planner import (
    ModelDoesNotFitError,
    NoFeasiblePlanError,
    Problem,
    Workload,
    automap,
    cluster_preset,
    compositions,
    d_cost,
    dataflow_preset,
    set_partitions,
)
from workbench.planner.automap import AutoMapper


def test_fifteen_placements_for_four_models():
    parts = list(set_partitions(["actor", "critic", "reference", "reward"]))
    assert len(parts) == 15
    assert len({frozenset(frozenset(b) for b in p) for p in parts}) == 15
    for p in parts:
        assert sorted(m for block in p for m in block) == ["actor", "critic", "reference", "reward"]


@pytest.mark.parametrize("n,bell", [(1, 1), (2, 2), (3, 5), (5, 52)])
def test_bell_numbers(n, bell):
    assert len(list(set_partitions("abcde"[:n]))) == bell


@pytest.mark.parametrize("total,k", [(8, 1), (8, 2), (8, 4), (16, 3), (32, 4), (64, 2)])
def test_allocation_counts_are_integer_compositions(total, k):
    allocs = list(compositions(total, [1] * k))
    assert len(allocs) == math.comb(total - 1, k - 1)
    assert len(set(allocs)) == len(allocs)
    assert all(sum(a) == total and min(a) >= 1 for a in allocs)


def test_allocation_starts_at_minimums():
    allocs = list(compositions(16, [4, 2, 1]))
    # Shift by the minimums: compositions of 16 - 7 + 3 = 12 into 3 parts.
    assert len(allocs) == math.comb(16 - 7 + 3 - 1, 2)
    assert all(a >= 4 and b >= 2 and c >= 1 for a, b, c in allocs)
    assert list(compositions(4, [3, 2])) == []


def test_d_cost_hand_made():
    # Two colocated sets, three stages: max per stage, summed.
    assert d_cost([[10, 2, 5], [4, 3, 7]]) == 10 + 3 + 7
    # One set: plain sum.
    assert d_cost([[1, 2, 3]]) == 6
    # Standalone (4 sets), generation only on the actor's set.
    assert d_cost([[8, 0, 4], [0, 2, 4], [0, 3, 0], [0, 1, 0]]) == 8 + 3 + 4


def test_set_stage_costs_add_inside_a_colocated_set():
    flow = dataflow_preset("ppo")
    m = AutoMapper(Problem(flow, "tiny-10m", Workload.tiny(), cluster_preset("local")))
    both = m.set_cost(("critic", "reward"), 2)[0]
    critic = m.set_cost(("critic",), 2)[0]
    reward = m.set_cost(("reward",), 2)[0]
    assert both[1] == pytest.approx(critic[1] + reward[1])
    assert both[2] == pytest.approx(critic[2])


def test_automap_small_case_is_exhaustive_over_placements_and_allocations():
    flow = dataflow_preset("ppo")
    cluster = cluster_preset("local")  # 4 devices
    plan = automap(Problem(flow, "tiny-10m", Workload.tiny(), cluster))
    assert plan.stats["placements"] == 15
    # Every placement's allocations: sum over partitions of C(4-1, k-1).
    expected = sum(math.comb(3, len(p) - 1) for p in set_partitions(flow.models))
    assert plan.stats["allocations"] == expected
    assert sum(plan.allocation) == 4
    assert plan.iteration_time == pytest.approx(sum(plan.level_times))
    assert plan.peak_memory <= cluster.device_memory
    # Best by brute force over the same cost tables.
    m = AutoMapper(Problem(flow, "tiny-10m", Workload.tiny(), cluster))
    brute = min(
        d_cost([m.set_cost(p, a)[0] for p, a in zip(part, alloc)])
        for part in set_partitions(flow.models)
        for alloc in compositions(4, [1] * len(part))
    )
    assert plan.iteration_time == pytest.approx(brute)


def test_actor_generation_layout_divides_training_layout():
    plan = automap(Problem(dataflow_preset("ppo"), "llama2-7b", Workload(), cluster_preset("a100_80g", 16)))
    a = plan.set_of("actor").assignments["actor"]
    assert a.generation is not None
    assert a.strategy.pp % a.generation.pp == 0 and a.strategy.tp % a.generation.tp == 0
    assert a.generation.world_size == a.strategy.world_size
    for s in plan.sets:
        assert sum(s.devices_per_node) == s.n_devices
        assert all(x.strategy.world_size == s.n_devices for x in s.assignments.values())


def test_strategy_cache_is_per_model_and_device_count():
    flow = dataflow_preset("ppo")
    m = AutoMapper(Problem(flow, "llama2-7b", Workload(), cluster_preset("a100_80g", 8)))
    m.run()
    assert all(isinstance(k, tuple) and len(k) == 2 for k in m._layouts)
    assert len(m._layouts) <= 4 * 8


def test_model_that_cannot_fit_names_model_and_shortfall():
    with pytest.raises(ModelDoesNotFitError) as e:
        automap(Problem(dataflow_preset("ppo"), "llama2-70b", Workload(), cluster_preset("a100_80g", 8)))
    err = e.value
    assert err.model == "actor" and err.short_bytes > 0
    assert "'actor'" in str(err) and "short by" in str(err) and "GiB" in str(err)


def test_models_that_fit_alone_but_not_together():
    with pytest.raises(NoFeasiblePlanError, match="least devices per model"):
        automap(Problem(dataflow_preset("ppo"), "llama2-70b", Workload(), cluster_preset("a100_80g", 32)))
