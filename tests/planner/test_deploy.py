"""A plan drives real resources: its pools and layouts become Ray placement groups and groups."""

from tests.controller.workers import EchoWorker
from workbench.planner import Workload, automap, cluster_preset, dataflow_preset


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
