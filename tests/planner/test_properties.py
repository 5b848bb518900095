"""Properties of auto-mapping on the HybridFlow testbed (A100-80GB x 8 per machine, Llama 2
7B-70B, 1024 + 1024 tokens, batch 1024): feasibility, monotonicity, memory accounting,
aligned allocations. Pure Python; every plan of the grid is computed once."""

import itertools
import math

import pytest

from workbench.planner import (
    ModelDoesNotFitError,
    NoFeasiblePlanError,
    Problem,
    Workload,
    automap,
    cluster_preset,
    dataflow_preset,
)
from workbench.planner.automap import AutoMapper
from workbench.planner.memory import generation_memory, inference_activations, static_memory, train_activations
from workbench.planner.strategy import strategies

MODELS = ["llama2-7b", "llama2-13b", "llama2-34b", "llama2-70b"]
DEVICES = [8, 16, 32, 64, 128]
FLOW = dataflow_preset("ppo")


@pytest.fixture(scope="module")
def grid():
    """{(model, devices): Plan or None when nothing fits}. 128 devices for the smallest and the
    largest model only: each such plan takes seconds to search, the others a fraction of one."""
    out = {}
    for model, n in itertools.product(MODELS, DEVICES):
        if n == 128 and model not in (MODELS[0], MODELS[-1]):
            continue
        try:
            out[model, n] = automap(Problem(FLOW, model, Workload(), cluster_preset("a100_80g", n)))
        except (ModelDoesNotFitError, NoFeasiblePlanError):
            out[model, n] = None
    return out


def test_more_devices_never_give_a_slower_best_plan(grid):
    for model in MODELS:
        costs = [grid[model, n] and grid[model, n].iteration_time for n in DEVICES if (model, n) in grid]
        feasible = [c for c in costs if c is not None]
        assert feasible, model
        first = costs.index(feasible[0])
        assert all(c is not None for c in costs[first:]), f"{model}: feasible, then not: {costs}"
        assert all(b <= a * (1 + 1e-12) for a, b in zip(feasible, feasible[1:])), (model, costs)


def _memory_model_peak(plan, colocated):
    """The set's per-device peak recomputed from the memory model: all static memory plus the
    largest call's dynamic memory (the actor's generation from Table 2 and its KV cache)."""
    wl, q = plan.workload, plan.cluster.device_memory
    statics = {
        m: static_memory(a.spec, a.strategy, FLOW.trained(m), wl.param_sharding)
        for m, a in colocated.assignments.items()
    }
    total_static = sum(s.total for s in statics.values())
    dynamic = 0.0
    for m, a in colocated.assignments.items():
        for call in FLOW.calls_of(m):
            if call.kind == "train":
                dynamic = max(dynamic, train_activations(a.spec, a.strategy, wl))
            elif call.kind == "inference":
                dynamic = max(dynamic, inference_activations(a.spec, a.strategy, wl))
            else:
                gm = generation_memory(
                    a.spec,
                    a.strategy,
                    a.generation,
                    wl,
                    statics[m].params,
                    q - total_static,
                    wl.transition,
                    call.batch_factor,
                )
                dynamic = max(dynamic, gm.dynamic)
    return total_static + dynamic


def test_every_plan_fits_and_its_memory_is_the_memory_models_sum(grid):
    checked = 0
    for plan in filter(None, grid.values()):
        for colocated in plan.sets:
            assert colocated.peak_memory <= plan.cluster.device_memory
            assert colocated.peak_memory == pytest.approx(_memory_model_peak(plan, colocated), rel=1e-9)
            per_model = sum(a.memory.static for a in colocated.assignments.values()) + max(
                a.memory.dynamic for a in colocated.assignments.values()
            )
            assert colocated.peak_memory == pytest.approx(per_model, rel=1e-9)
            checked += 1
    assert checked >= 20


def test_allocations_are_node_aligned_on_multi_machine_presets(grid):
    for (model, n), plan in grid.items():
        if plan is None:
            continue
        used = set()
        for s in plan.sets:
            devices = set(s.devices)
            assert not devices & used, f"{model}/{n}: sets overlap"
            used |= devices
            if s.n_devices >= 8:
                assert s.n_devices % 8 == 0 and s.first_device % 8 == 0, (model, n, s.name)
            else:
                assert 8 % s.n_devices == 0 and s.first_device % s.n_devices == 0, (model, n, s.name)
                assert len(s.nodes) == 1
        assert max(used) < n


def _fits_at_common_layout(mapper, models, n):
    """A strategy every model of the set admits, with the actor generating in the same layout,
    whose memory (memory model) fits: then the set must not be reported infeasible."""
    q, wl = mapper.cluster.device_memory, mapper.wl
    specs = {m: mapper.specs[m] for m in models}
    common = set.intersection(*(set(strategies(specs[m], n, 8)) for m in models))
    for s in sorted(common):
        statics = {m: static_memory(specs[m], s, FLOW.trained(m), wl.param_sharding) for m in models}
        total = sum(x.total for x in statics.values())
        dyn = max(
            train_activations(specs[m], s, wl) if FLOW.trained(m) else inference_activations(specs[m], s, wl)
            for m in models
        )
        if "actor" in models:
            gm = generation_memory(specs["actor"], s, s, wl, statics["actor"].params, q - total)
            if gm is None:
                continue
            dyn = max(dyn, gm.dynamic)
        if total + dyn <= q:
            return s
    return None


@pytest.mark.parametrize("model", ["llama2-7b", "llama2-13b", "llama2-34b"])
def test_a_set_that_fits_at_a_common_layout_is_never_infeasible(model):
    mapper = AutoMapper(Problem(FLOW, model, Workload(), cluster_preset("a100_80g", 32)))
    fitting = 0
    for k in (1, 2, 3, 4):
        for models in itertools.combinations(FLOW.models, k):
            for n in (8, 16, 32):
                s = _fits_at_common_layout(mapper, models, n)
                if s is not None:
                    fitting += 1
                    assert mapper.set_cost(models, n) is not None, (models, n, str(s))
    assert fitting > 10


def test_seven_b_all_colocated_on_sixteen_fits():
    # The example: all four 7B models at p1t8d2 need about 23 GB per device.
    mapper = AutoMapper(Problem(FLOW, "llama2-7b", Workload(), cluster_preset("a100_80g", 16)))
    result = mapper.set_cost(FLOW.models, 16)
    assert result is not None and result[2] <= 80e9


def test_actor_layouts_are_chosen_with_generation():
    # 7B actor alone on 8 GPUs: the pair minimises train + generation + switch, so its time
    # is no worse than any single (training, generation) pair's.
    mapper = AutoMapper(Problem(FLOW, "llama2-7b", Workload(), cluster_preset("a100_80g", 8)))
    stages, choices, _ = mapper.set_cost(("actor",), 8)
    best = choices["actor"].time
    q = mapper.cluster.device_memory
    for layout in mapper.layouts("actor", 8):
        c = mapper._generating_choice("actor", layout, q - layout.static.total)
        if c is not None and layout.static.total + c.dynamic.total <= q:
            assert best <= c.time * (1 + 1e-12)
    assert math.isclose(sum(stages), best)


def test_free_allocation_is_still_available_and_monotone():
    costs = []
    for n in (8, 16, 32):
        plan = automap(Problem(FLOW, "llama2-7b", Workload(), cluster_preset("a100_80g", n)), allocation="free")
        assert plan.stats["allocation_policy"] == "free"
        costs.append(plan.iteration_time)
        # Free splits may cut across machine boundaries; the aligned default never does.
        assert sum(plan.allocation) <= n
    assert costs == sorted(costs, reverse=True)
    with pytest.raises(ValueError, match="allocation='odd'"):
        automap(Problem(FLOW, "llama2-7b", Workload(), cluster_preset("a100_80g", 8)), allocation="odd")
