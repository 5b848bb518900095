"""A plan drives real resources: its pools and layouts become Ray placement groups and groups."""

import pytest
import torch

from tests.controller.workers import EchoWorker
from workbench.data.prompts import tokenize_prompts
from workbench.deploy import deploy_plan, plan_pools
from workbench.engines.rollout import SamplingConfig
from workbench.errors import ConfigError
from workbench.models import load, make_tiny
from workbench.planner import PlannerError, Problem, Workload, automap, cluster_preset, dataflow_preset
from workbench.workers import ActorConfig, ActorRolloutRefWorker
from workbench.workers.critic import CriticConfig, CriticWorker
from workbench.workers.reward import RewardModelWorker, ScoreModelConfig


def test_plan_pools_creates_the_planned_placement(session):
    plan = automap(Problem(dataflow_preset("ppo"), "llama2-13b", Workload(), cluster_preset("a100_80g", 8)))
    layouts = plan_pools(plan, session)
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
    return automap(Problem(dataflow_preset("ppo"), "tiny-1m", Workload.tiny(), cluster_preset("local", 4), **limits))


def test_deploy_starts_a_group_per_model_and_fuses_equal_layouts(session):
    plan = local_plan(max_tp=1, max_pp=1)
    groups = deploy_plan(plan, session, {m: (EchoWorker, None) for m in plan.dataflow.models})
    assert set(groups) == set(plan.dataflow.models)
    for colocated in plan.sets:
        pids = {m: {w["pid"] for w in groups[m].where().get()} for m in colocated.models}
        assert all(len(p) == colocated.n_devices for p in pids.values())
        # every model here is data parallel over the whole set: one process per device for all
        assert len(set().union(*pids.values())) == colocated.n_devices


def test_deploy_refuses_before_reserving_anything(session):
    plan = local_plan(max_tp=1, max_pp=1)
    with pytest.raises(PlannerError, match=r"missing \['critic'\]"):
        deploy_plan(plan, session, {m: (EchoWorker, None) for m in plan.dataflow.models if m != "critic"})
    tp_plan = automap(Problem(dataflow_preset("ppo"), "llama2-13b", Workload(), cluster_preset("a100_80g", 8)))
    fsdp = {m: (EchoWorker, CriticConfig(model_path="/not/read/before/the/layout")) for m in tp_plan.dataflow.models}
    with pytest.raises(ConfigError, match="data parallelism only"):
        deploy_plan(tp_plan, session, fsdp)
    assert not session.pools


def test_a_tensor_parallel_plan_deploys_and_runs(session, tmp_path):
    """The planner puts the 10M actor and critic on p1t2d2 on 4 local devices: the plan starts
    for real, the actor generates through the hybrid engine and its critic scores."""
    plan = automap(
        Problem(dataflow_preset("ppo"), "tiny-10m", Workload.tiny(), cluster_preset("local", 4), max_tp=4, max_pp=1)
    )
    actor = plan.set_of("actor").assignments["actor"]
    assert actor.strategy.tp > 1, f"the planner no longer picks tensor parallelism here: {actor.strategy}"
    model = str(make_tiny("10m", tmp_path / "m10"))
    groups = deploy_plan(
        plan,
        session,
        {
            "actor": (
                ActorRolloutRefWorker,
                ActorConfig(model_path=model, backend="3d", mini_batch_size=4, micro_batch_size=2),
            ),
            "reference": (
                ActorRolloutRefWorker,
                ActorConfig(model_path=model, backend="3d", train=False, rollout=None, reference=True),
            ),
            "critic": (
                CriticWorker,
                CriticConfig(model_path=model, backend="3d", mini_batch_size=4, micro_batch_size=2),
            ),
            "reward": (RewardModelWorker, ScoreModelConfig(model)),
        },
    )
    assert groups["actor"].mesh.tp == actor.strategy.tp
    tokenizer = load(model).tokenizer
    rows = [{"prompt": f"{i}+{i}=", "ground_truth": str(2 * i)} for i in range(4)]
    out = groups["actor"].generate_sequences(
        tokenize_prompts(rows, tokenizer, 16), SamplingConfig(max_new_tokens=3, n=1, seed=0)
    )
    values = groups["critic"].compute_values(out).get()["values"]
    scored = groups["actor"].compute_log_prob(out).get()
    ref = groups["reference"].compute_ref_log_prob(out).get()
    assert values.shape == (4, 3) and torch.isfinite(values).all()
    assert torch.allclose(ref["ref_log_probs"], scored["old_log_probs"], atol=1e-5)


def test_layout_limits_bound_the_plan():
    plan = local_plan(max_tp=1, max_pp=1)
    for colocated in plan.sets:
        for a in colocated.assignments.values():
            assert (a.strategy.tp, a.strategy.pp) == (1, 1)
            assert a.generation is None or (a.generation.tp, a.generation.pp) == (1, 1)


def test_model_mesh_carries_the_generation_layout_and_transition_method():
    from workbench import Mesh
    from workbench.deploy.plans import model_mesh
    from workbench.planner import model_preset
    from workbench.planner.memory import transition
    from workbench.planner.plan import ModelAssignment

    spec, train, gen = model_preset("llama2-13b"), Mesh(1, 4, 2), Mesh(1, 2, 4)
    actor = ModelAssignment("actor", spec, train, gen, transition=transition(spec, train, gen, "vanilla"))
    mesh = model_mesh(actor)
    assert (mesh.tp, mesh.dp, mesh.gen_tp, mesh.transition) == (4, 2, 2, "vanilla")
    assert model_mesh(ModelAssignment("critic", spec, train)).transition == "hybridflow"
