"""A plan drives real resources: its pools and layouts become Ray placement groups and groups."""

import pytest

from tests.controller.workers import EchoWorker
from workbench.planner import PlannerError, Workload, automap, cluster_preset, dataflow_preset


def test_plan_to_pools_creates_the_planned_placement(session):
    plan = automap(dataflow_preset("ppo"), "llama2-13b", Workload(), cluster_preset("a100_80g", 8))
    layouts = plan.to_pools(session)
    assert set(layouts) == {"actor", "critic", "reference", "reward"}
    for colocated in plan.sets:
        pool = session.pools[colocated.name]
        assert pool.world_size == colocated.n_devices
        assert {layouts[m].pool.name for m in colocated.models} == {colocated.name}
    actor = plan.set_of("actor").assignments["actor"]
    mesh = layouts["actor"].mesh
    assert (mesh.pp, mesh.tp, mesh.dp) == (actor.strategy.pp, actor.strategy.tp, actor.strategy.dp)
    # Groups on the planned layouts start and see their planned coordinates.
    critic_pool, critic_mesh = layouts["critic"]
    critic = session.group("critic", EchoWorker, critic_pool, mesh=critic_mesh)
    coords = [w["coord"] for w in critic.where().get()]
    assert coords == [tuple(critic_mesh.coord(r)) for r in range(critic_mesh.world_size)]


def local_plan(**limits):
    return automap(dataflow_preset("ppo"), "tiny-1m", Workload.tiny(), cluster_preset("local", 4), **limits)


def test_deploy_starts_a_group_per_model_and_fuses_equal_layouts(session):
    plan = local_plan(max_tp=1, max_pp=1)
    groups = plan.deploy(session, {m: (EchoWorker, None) for m in plan.dataflow.models})
    assert set(groups) == set(plan.dataflow.models)
    for colocated in plan.sets:
        pids = {m: {w["pid"] for w in groups[m].where().get()} for m in colocated.models}
        assert all(len(p) == colocated.n_devices for p in pids.values())
        # every model here is data parallel over the whole set: one process per device for all
        assert len(set().union(*pids.values())) == colocated.n_devices


def test_deploy_refuses_before_reserving_anything(session):
    plan = local_plan(max_tp=1, max_pp=1)
    with pytest.raises(PlannerError, match=r"missing \['critic'\]"):
        plan.deploy(session, {m: (EchoWorker, None) for m in plan.dataflow.models if m != "critic"})
    tp_plan = automap(dataflow_preset("ppo"), "llama2-13b", Workload(), cluster_preset("a100_80g", 8))
    with pytest.raises(PlannerError, match="data parallelism only.*max_tp=1, max_pp=1"):
        tp_plan.deploy(session, {m: (EchoWorker, None) for m in tp_plan.dataflow.models})
    assert not session.pools


def test_layout_limits_bound_the_plan():
    plan = local_plan(max_tp=1, max_pp=1)
    for colocated in plan.sets:
        for a in colocated.assignments.values():
            assert (a.strategy.tp, a.strategy.pp) == (1, 1)
            assert a.generation is None or (a.generation.tp, a.generation.pp) == (1, 1)


def test_model_mesh_carries_the_generation_layout_and_transition_method():
    from workbench.planner import ParallelStrategy, model_preset
    from workbench.planner.deploy import model_mesh
    from workbench.planner.memory import transition
    from workbench.planner.plan import ModelAssignment

    spec, train, gen = model_preset("llama2-13b"), ParallelStrategy(1, 4, 2), ParallelStrategy(1, 2, 4)
    actor = ModelAssignment("actor", spec, train, gen, transition=transition(spec, train, gen, "vanilla"))
    mesh = model_mesh(actor)
    assert (mesh.tp, mesh.dp, mesh.gen_tp, mesh.transition) == (4, 2, 2, "vanilla")
    assert model_mesh(ModelAssignment("critic", spec, train)).transition == "hybridflow"
