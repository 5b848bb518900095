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


def tp_plan():
    """The planner's plan for PPO on llama2-7b over 4 A100s: all four models on one set, tensor
    parallel (p1t4d1)."""
    return automap(Problem(dataflow_preset("ppo"), "llama2-7b", Workload(), cluster_preset("a100_80g", 4)))


def test_plan_pools_creates_the_planned_placement(session):
    plan = tp_plan()
    layouts = plan_pools(plan, session)
    assert set(layouts) == {"actor", "critic", "reference", "reward"}
    for colocated in plan.sets:
        pool = session.pools[colocated.name]
        assert pool.world_size == colocated.n_devices
        assert {layouts[m].pool.name for m in colocated.models} == {colocated.name}
    actor = plan.set_of("actor").assignments["actor"]
    mesh = layouts["actor"].mesh
    assert (mesh.pp, mesh.tp, mesh.dp) == (actor.strategy.pp, actor.strategy.tp, actor.strategy.dp)
    assert mesh.tp > 1, f"the planner no longer picks tensor parallelism here: {actor.strategy}"
    # Groups on the planned layouts start and see their planned coordinates: the four models
    # share one (pp, tp, dp) here, so they share one process per device as deploy_plan starts
    # them (and the next test's four groups on 4 devices take these processes warm).
    shared = {(p.name, m.pp, m.tp, m.dp) for p, m in layouts.values()}
    assert len(shared) == 1, layouts
    groups = session.fused(layouts["critic"].pool, mesh=mesh, **{m: EchoWorker for m in layouts})
    for model, group in groups.items():
        planned = layouts[model].mesh
        coords = [w["coord"] for w in group.where().get()]
        assert coords == [tuple(planned.coord(r)) for r in range(planned.world_size)], model


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
    tensor_parallel = tp_plan()
    fsdp = {
        m: (EchoWorker, CriticConfig(model_path="/not/read/before/the/layout")) for m in tensor_parallel.dataflow.models
    }
    with pytest.raises(ConfigError, match="data parallelism only"):
        deploy_plan(tensor_parallel, session, fsdp)
    assert not session.pools


def test_a_tensor_parallel_plan_deploys_and_runs(session, tmp_path):
    """The planner puts the 10M actor on p1t2d1 on 2 local devices: the plan starts for real,
    the actor generates through the hybrid engine, its critic scores and the reference's
    log-probs equal the actor's."""
    plan = automap(
        Problem(dataflow_preset("ppo"), "tiny-10m", Workload.tiny(), cluster_preset("local", 2), max_tp=2, max_pp=1)
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
