"""A per-call plan runs: every call on its planned mesh, a trained model's replica brought up to
date through a weight channel, and PPO's metrics equal those of the colocated plan."""

import dataclasses
import math
import sys
import time

import pytest
import ray
import torch

from algorithms import PPO, Groups, PPOConfig
from tests.controller.workers import EchoWorker
from workbench.data import arithmetic
from workbench.data.prompts import tokenize_prompts
from workbench.deploy import deploy_calls
from workbench.deploy.routing import CallRouter
from workbench.engines.contract import OptimConfig
from workbench.engines.rollout import SamplingConfig
from workbench.mesh import Mesh
from workbench.models import load, make_tiny
from workbench.models.value import load_value_model
from workbench.planner import DeviceRange, ExecutionPlan, PlannerError, Problem, dataflow_preset
from workbench.planner.call_groups import plan_groups, runtime_refusal
from workbench.workers import ActorConfig, ActorRolloutRefWorker
from workbench.workers.critic import CriticConfig, CriticWorker
from workbench.workers.reward import RewardModelWorker, ScoreModelConfig

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

PPO_FLOW = dataflow_preset("ppo")
D0, D1, D01 = DeviceRange(0, 1), DeviceRange(1, 1), DeviceRange(0, 2)
ONE = Mesh(1, 1, 1)


def per_call(**moved: DeviceRange) -> ExecutionPlan:
    """Every PPO call on d0 (one device, p1t1d1) except the ones moved."""
    return ExecutionPlan({c.name: (moved.get(c.name, D0), ONE) for c in PPO_FLOW.calls})


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    model = str(make_tiny("1m", tmp_path_factory.mktemp("calls") / "m", seed=3))
    # A reward model with its head saved: a head initialised in the worker would depend on what
    # else its process built first (RewardModelWorker does not seed it), so plans would differ.
    torch.manual_seed(0)
    scorer = load_value_model(model)
    reward_dir = str(tmp_path_factory.mktemp("calls") / "reward")
    scorer.model.save_pretrained(reward_dir)
    scorer.tokenizer.save_pretrained(reward_dir)
    problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), 8, seed=1)
    prompts = tokenize_prompts([p.__dict__ for p in problems], load(model).tokenizer, max_prompt_length=32)
    optim = OptimConfig(lr=1e-3)
    workers = {
        "actor": (ActorRolloutRefWorker, ActorConfig(model, optim=optim, mini_batch_size=8, micro_batch_size=4)),
        "reference": (ActorRolloutRefWorker, ActorConfig(model, train=False, rollout=None, reference=True)),
        "critic": (CriticWorker, CriticConfig(model, optim=optim, mini_batch_size=8, micro_batch_size=4)),
        "reward": (RewardModelWorker, ScoreModelConfig(reward_dir)),
    }
    return {"workers": workers, "batches": [prompts[:4], prompts[4:]]}


def ppo_metrics(handles, batches, iterations=2):
    """Two PPO iterations (pi_old recomputed: the actor's inference call runs too); what they
    learned, without the clocks."""
    config = PPOConfig(sampling=SamplingConfig(max_new_tokens=6, n=2, seed=0), kl_coef=0.05, old_log_probs="recompute")
    metrics = PPO(Groups(**handles), config).fit(batches, iterations, log=None)
    return [{k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/"))} for m in metrics]


@pytest.fixture(scope="module")
def colocated(shared_session, kit):
    """The colocated plan's handles' names and its two PPO iterations' metrics: the reference
    the other plans' iterations are compared with (a one-iteration run is its first)."""
    handles = deploy_calls(per_call(), shared_session, kit["workers"], PPO_FLOW)
    names = set(handles)
    metrics = ppo_metrics(handles, kit["batches"])
    shared_session.clear()
    return names, metrics


def test_calls_on_other_meshes_match_the_colocated_plan(session, kit, colocated):
    names, expected = colocated
    assert names == {"actor", "reference", "critic", "reward"}

    # The actor generates on d1 (a rollout group) and the critic's values run on d1 (a replica)
    # while both train on d0.
    since = time.time()
    handles = deploy_calls(per_call(gen=D1, values=D1), session, kit["workers"], PPO_FLOW)
    assert set(handles) == {"actor", "reference", "critic", "reward", "rollout"}
    critic = handles["critic"]
    assert isinstance(critic, CallRouter) and critic.routes["compute_values"].role == "critic_d1"
    assert handles["actor"].config.rollout is None  # the home no longer generates
    hosts = {role: group.hostset for role, group in session.groups.items()}
    assert hosts["rollout"] is hosts["critic_d1"] and hosts["actor"] is hosts["critic"]  # fused per mesh
    assert hosts["rollout"] is not hosts["actor"]
    got = ppo_metrics(handles, kit["batches"])

    assert len(got) == len(expected) == 2
    for mine, theirs in zip(got, expected):
        assert mine.keys() == theirs.keys()
        for key, value in theirs.items():
            assert mine[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert expected[0]["critic/vf_loss"] != expected[1]["critic/vf_loss"]  # the critic learned

    spans = [r for r in session.trace() if r.start >= since]
    ran = {(r.role, r.method) for r in spans}
    assert {("critic_d1", "compute_values"), ("rollout", "generate_sequences")} <= ran
    assert ("critic", "compute_values") not in ran and ("actor", "generate_sequences") not in ran
    sent = [r for r in spans if r.method == "replica.send_weights" and r.rank == 0]
    received = [r for r in spans if r.method == "replica.receive_weights"]
    assert [r.extra["version"] for r in received] == [0, 1]  # before each iteration's values
    assert [r.extra["bytes_received"] for r in received] == [r.extra["bytes_sent"] for r in sent]
    assert sent[0].extra["bytes_sent"] > 0
    assert critic.version == 2 and critic.held == {"critic_d1": 1}


def test_a_searched_plan_deploys_and_runs(session, kit, colocated):
    """The search, kept to plans this runtime runs and to one-device meshes of a 2-device
    machine, spreads PPO's calls over both devices; the plan deploys, and its iteration equals
    the colocated plan's."""
    from workbench.planner import PlanSpace, Workload, cluster_preset, multi_chain
    from workbench.planner.call_groups import runtime_refusal

    space = PlanSpace(
        Problem(PPO_FLOW, "tiny-1m", Workload.tiny(), cluster_preset("local", 2), max_tp=1, max_pp=1),
        meshes=[D0, D1],
        runnable=True,
    )
    plan = multi_chain(space, (0, 1), max_steps=300).plan
    assert runtime_refusal(plan, PPO_FLOW) is None
    assert len({mesh for mesh, _ in plan.layouts.values()}) == 2, plan.describe()
    handles = deploy_calls(plan, session, kit["workers"], PPO_FLOW)
    [metrics] = ppo_metrics(handles, kit["batches"][:1], iterations=1)
    assert {p.name for p in session.pools.values()} == {"calls_d0", "calls_d1"}
    expected = colocated[1][0]
    assert metrics.keys() == expected.keys() and all(math.isfinite(v) for v in metrics.values())
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_meshes_that_share_some_devices_run_on_slices_of_one_pool(session, kit, colocated):
    """The actor and critic on d0, the reference on d0-1 (two data-parallel ranks), the reward on
    d1: one pool spans d0-1 and the one-device meshes are its slices; the iteration equals the
    colocated plan's, and the reference's rank on d0 waits its turn behind the actor."""
    plan = per_call(reward=D1)
    plan.layouts["ref"] = (D01, Mesh(1, 1, 2))
    handles = deploy_calls(plan, session, kit["workers"], PPO_FLOW)
    pools = {name: pool for name, pool in session.pools.items()}
    assert set(pools) == {"calls_d0-1", "calls_d0", "calls_d1"}
    assert pools["calls_d0"].parent == pools["calls_d1"].parent == "calls_d0-1"
    assert (pools["calls_d0"].devices, pools["calls_d1"].devices) == ((0,), (1,))
    hosts = {role: group.hostset for role, group in session.groups.items()}
    assert hosts["actor"] is hosts["critic"] and hosts["actor"].pool.name == "calls_d0"
    assert hosts["reference"].pool.name == "calls_d0-1" and hosts["reward"].pool.name == "calls_d1"
    since = time.time()
    [got] = ppo_metrics(handles, kit["batches"][:1], iterations=1)
    spans = [r for r in session.trace() if r.start >= since]
    expected = colocated[1][0]
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    ref = [r for r in spans if (r.role, r.method) == ("reference", "compute_ref_log_prob")]
    assert sorted(r.rank for r in ref) == [0, 1]
    on_d0 = [r for r in spans if r.role in ("actor", "critic") and r.rank == 0]
    for r in ref:  # on device 0 nothing of the actor's process runs inside the reference's call
        if r.rank == 0:
            assert all(o.end <= r.start + 1e-3 or o.start >= r.end - 1e-3 for o in on_d0), r


def test_a_trained_models_copies_on_devices_its_home_shares_match_copies_apart(session, kit):
    """The actor's generation and the critic's values on d0-1 (two ranks each) while both train
    on d0: the copies share d0 with their home, take their weights through joint calls and take
    turns there; the iteration equals the one with the same copies on d1-2, apart."""
    two = Mesh(1, 1, 2)
    shared = per_call()
    shared.layouts |= {"gen": (D01, two), "values": (D01, two)}
    since = time.time()
    handles = deploy_calls(shared, session, kit["workers"], PPO_FLOW)
    assert {name: p.parent for name, p in session.pools.items()} == {"calls_d0-1": None, "calls_d0": "calls_d0-1"}
    hosts = {role: group.hostset for role, group in session.groups.items()}
    assert hosts["rollout"] is hosts["critic_d0-1"] and hosts["rollout"].pool.name == "calls_d0-1"
    assert hosts["actor"] is hosts["critic"] and hosts["actor"].pool.name == "calls_d0"
    [got] = ppo_metrics(handles, kit["batches"][:1], iterations=1)
    handles["critic"].check()  # the pushes finished without error
    spans = [r for r in session.trace() if r.start >= since]
    session.clear()

    # Apart second: its two-rank pool takes the shared run's two-rank processes warm.
    apart = per_call()
    apart.layouts |= {"gen": (DeviceRange(1, 2), two), "values": (DeviceRange(1, 2), two)}
    [expected] = ppo_metrics(deploy_calls(apart, session, kit["workers"], PPO_FLOW), kit["batches"][:1], 1)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    received = [r for r in spans if r.method in ("replica.receive_weights", "async.receive_weights")]
    assert {r.rank for r in received} == {0, 1} and all(r.extra["bytes_received"] > 0 for r in received)
    # On d0 the copies' rank and the home's process take turns, except in the pushes' joint calls.
    pushes = ("send_weights", "receive_weights", "join_weight_channel")
    home = [r for r in spans if r.role in ("actor", "critic") and r.rank == 0 and r.method not in pushes]
    copies = [r for r in spans if r.role in ("rollout", "critic_d0-1") and r.rank == 0 and r.method not in pushes]
    assert home and copies
    for c in copies:
        if "." not in c.method:  # a call's own span, not a span recorded inside it
            assert all(h.end <= c.start + 1e-3 or h.start >= c.end - 1e-3 for h in home if "." not in h.method), c


def test_values_beside_a_tensor_parallel_critic_equal_its_own(session, kit):
    """The critic trains p1t2d1 on d0-1 and its values run p1t1d2 on a replica beside it: PPO
    runs, and after the update the replica's values equal the home's own tensor-parallel
    forward. The replica is reallocated into straight from the home's pieces: each home rank
    sends its half of every cut weight to both replica ranks, no gather."""
    import dataclasses

    plan = ExecutionPlan({c.name: (D01, Mesh(1, 1, 2)) for c in PPO_FLOW.calls})
    plan.layouts["update_critic"] = (D01, Mesh(1, 2, 1))
    workers = dict(kit["workers"])
    cls, config = workers["critic"]
    workers["critic"] = (cls, dataclasses.replace(config, backend="3d"))
    since = time.time()
    handles = deploy_calls(plan, session, workers, PPO_FLOW)
    critic = handles["critic"]
    replica = critic.routes["compute_values"]
    assert replica.role == "critic_d0-1_p1t1d2" and replica.pool.name == critic.home.pool.name == "calls_d0-1"
    [metrics] = ppo_metrics(handles, kit["batches"][:1], iterations=1)
    assert all(math.isfinite(v) for v in metrics.values())
    gen = handles["actor"].generate_sequences(kit["batches"][1], SamplingConfig(max_new_tokens=6, seed=0))
    pushed = critic.compute_values(gen).get()["values"]  # the update's weights pushed first
    own = critic.home.compute_values(gen).get()["values"]
    assert critic.held == {"critic_d0-1_p1t1d2": 1} and critic.version == 1
    assert pushed.abs().sum() > 0 and torch.allclose(pushed, own, rtol=1e-5, atol=1e-6)
    received = [r for r in session.trace() if r.method == "replica.receive_weights" and r.start >= since]
    sent = [r for r in session.trace() if r.method == "replica.send_weights" and r.start >= since]
    model_bytes = sum(
        t.numel() * t.element_size() for t in load_value_model(config.model_path).model.state_dict().values()
    )
    assert len(received) == 4 and all(r.extra["layers"] > 2 for r in received)  # two pushes, two ranks
    assert all(r.extra["bytes_received"] == model_bytes for r in received)  # each a whole model
    assert sum(r.extra["bytes_sent"] for r in sent) == 4 * model_bytes and all(r.extra["bytes_sent"] for r in sent)


@pytest.mark.parametrize("replica_layout", ["p1t1d2", "p1t2d1"])
def test_a_critics_replica_is_reallocated_into_from_every_home_rank(session, kit, replica_layout):
    """The critic trains p1t1d2 on d0-1 (FSDP) and its values run on d1-2, data parallel or
    tensor parallel: the replica is brought up to date by reallocation, every home rank a source
    sending whole layers (or their slices: each tensor-parallel rank receives its pieces, in
    place), and after the update its values equal the home's own forward."""
    two = Mesh(1, 1, 2)
    plan = ExecutionPlan({c.name: (D01, two) for c in PPO_FLOW.calls})
    plan.layouts["values"] = (DeviceRange(1, 2), Mesh(1, 2, 1) if replica_layout == "p1t2d1" else two)
    since = time.time()
    handles = deploy_calls(plan, session, kit["workers"], PPO_FLOW)
    critic = handles["critic"]
    [metrics] = ppo_metrics(handles, kit["batches"][:1], iterations=1)
    assert all(math.isfinite(v) for v in metrics.values())
    gen = handles["actor"].generate_sequences(kit["batches"][1], SamplingConfig(max_new_tokens=6, seed=0))
    moved = critic.compute_values(gen).get()["values"]  # the update's weights reallocated first
    own = critic.home.compute_values(gen).get()["values"]
    assert critic.held == {"critic_d1-2": 1} and moved.abs().sum() > 0
    assert torch.allclose(moved, own, rtol=1e-5, atol=1e-6)

    spans = [r for r in session.trace() if r.start >= since]
    sent = [r for r in spans if r.method == "replica.send_weights"]
    received = [r for r in spans if r.method == "replica.receive_weights"]
    model_bytes = sum(
        t.numel() * t.element_size()
        for t in load_value_model(kit["workers"]["critic"][1].model_path).model.state_dict().values()
    )
    # two pushes (versions 0 and 1), each from both home ranks
    assert sorted((r.extra["version"], r.rank) for r in sent) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len(received) == 4 and all(r.extra["layers"] > 2 for r in sent + received)
    if replica_layout == "p1t1d2":  # each home rank sends one whole copy to its own copy rank
        assert all(r.extra["bytes_sent"] == model_bytes for r in sent)
        assert all(r.extra["bytes_received"] == model_bytes for r in received)
    else:  # each tensor-parallel rank receives its pieces: the cut weights' half, the whole ones
        assert all(model_bytes / 2 < r.extra["bytes_received"] < model_bytes for r in received)
        for version in (0, 1):
            moved = [r.extra["bytes_received"] for r in received if r.extra["version"] == version]
            assert sum(moved) == sum(r.extra["bytes_sent"] for r in sent if r.extra["version"] == version)


def test_overlapping_meshes_share_one_span():
    from workbench.planner.call_groups import spans

    d = DeviceRange
    assert spans([d(0, 4), d(0, 2), d(2, 2), d(4, 1), d(5, 1)]) == {
        d(0, 4): d(0, 4),
        d(0, 2): d(0, 4),
        d(2, 2): d(0, 4),
        d(4, 1): d(4, 1),
        d(5, 1): d(5, 1),
    }
    assert spans([d(0, 3), d(2, 2), d(6, 1)]) == {d(0, 3): d(0, 4), d(2, 2): d(0, 4), d(6, 1): d(6, 1)}  # chained
    assert spans([]) == {}


def test_unknown_calls_and_missing_models_are_refused(session):
    workers = {m: (EchoWorker, None) for m in PPO_FLOW.models}
    bad = per_call()
    bad.layouts["gen_greedy"] = (D1, ONE)
    with pytest.raises(PlannerError, match=r"call\(s\) \['gen_greedy'\] that dataflow 'ppo' does not have"):
        deploy_calls(bad, session, workers, PPO_FLOW)
    del workers["critic"]
    with pytest.raises(PlannerError, match=r"missing \['critic'\]"):
        deploy_calls(per_call(), session, workers, PPO_FLOW)
    assert not session.pools


def test_what_this_runtime_cannot_run_is_refused_with_the_call(kit):
    workers = kit["workers"]
    with pytest.raises(PlannerError, match=r"'old_log_prob' of model 'actor' .* compute_log_prob"):
        plan_groups(per_call(old_log_prob=D1), PPO_FLOW, workers)
    with pytest.raises(PlannerError, match=r"'old_log_prob' of model 'actor' .* compute_log_prob"):
        plan_groups(per_call(gen=D1, old_log_prob=D1), PPO_FLOW, workers)  # beside the rollout group too
    pp_values = ExecutionPlan({c.name: (D01, Mesh(1, 1, 2)) for c in PPO_FLOW.calls})
    pp_values.layouts["values"] = (DeviceRange(2, 2), Mesh(2, 1, 1))
    with pytest.raises(PlannerError, match=r"'values' of model 'critic' on d2-3 \(p2t1d1\): .* pp=1"):
        plan_groups(pp_values, PPO_FLOW, workers)
    # a tensor-parallel replica only by reallocation, which moves weights out of an FSDP home
    tp_values = ExecutionPlan({c.name: (D01, Mesh(1, 1, 2)) for c in PPO_FLOW.calls})
    tp_values.layouts["values"] = (DeviceRange(2, 2), Mesh(1, 2, 1))
    replica = {s.role: s for s in plan_groups(tp_values, PPO_FLOW, workers)}["critic_d2-3"]
    assert replica.worker[1].backend == "3d" and replica.layout.short() == "p1t2d1"
    cls, config = workers["critic"]
    deepspeed = {**workers, "critic": (cls, dataclasses.replace(config, backend="deepspeed"))}
    with pytest.raises(PlannerError, match=r"'values' of model 'critic' on d2-3 .* from an FSDP or tensor-parallel"):
        plan_groups(tp_values, PPO_FLOW, deepspeed)
    tp_values.layouts["update_critic"] = (D01, Mesh(2, 1, 1))  # a pipeline-parallel home
    with pytest.raises(PlannerError, match=r"'values' of model 'critic' on d2-3 .* \(pp=1\)"):
        plan_groups(tp_values, PPO_FLOW, workers)
    tp_rollout = ExecutionPlan({c.name: (D01, Mesh(1, 1, 2)) for c in PPO_FLOW.calls})
    tp_rollout.layouts["gen"] = (DeviceRange(2, 2), Mesh(1, 2, 1))
    with pytest.raises(PlannerError, match=r"'gen' of model 'actor' on d2-3 .* data parallelism only"):
        plan_groups(tp_rollout, PPO_FLOW, workers)


def test_a_call_in_another_layout_on_its_models_devices_runs_on_a_replica_beside_the_home(kit):
    """The critic trains tensor-parallel (p1t2d1) on d0-1 and computes values data-parallel
    (p1t1d2) there: a replica beside the home, on the same devices, holding the pushed weights as
    FSDP shards."""
    import dataclasses

    plan = ExecutionPlan({c.name: (D01, Mesh(1, 1, 2)) for c in PPO_FLOW.calls})
    plan.layouts["update_critic"] = (D01, Mesh(1, 2, 1))
    workers = dict(kit["workers"])
    cls, config = workers["critic"]
    workers["critic"] = (cls, dataclasses.replace(config, backend="3d"))
    specs = {s.role: s for s in plan_groups(plan, PPO_FLOW, workers)}
    assert set(specs) == {"actor", "reference", "critic", "reward", "critic_d0-1_p1t1d2"}
    replica = specs["critic_d0-1_p1t1d2"]
    assert (replica.mesh, replica.layout.short(), replica.calls, replica.home) == (D01, "p1t1d2", ["values"], "critic")
    assert (replica.worker[1].backend, specs["critic"].worker[1].backend) == ("fsdp", "3d")
    assert specs["critic"].calls == ["update_critic"] and specs["critic"].layout.short() == "p1t2d1"


def test_the_actors_generation_in_another_layout_on_its_devices_is_the_hybrid_engines(kit):
    plan = ExecutionPlan({c.name: (D01, Mesh(1, 2, 1)) for c in PPO_FLOW.calls})
    plan.layouts["gen"] = (D01, Mesh(1, 1, 2))
    specs = {s.role: s for s in plan_groups(plan, PPO_FLOW, kit["workers"])}
    assert set(specs) == {"actor", "reference", "critic", "reward"}  # no replica: one group per model
    actor = specs["actor"].layout
    assert (actor.tp, actor.dp, actor.gen_tp, actor.transition) == (2, 1, 1, "hybridflow")
    assert specs["actor"].calls == ["gen", "old_log_prob", "update_actor"]


def test_pipeline_stages_generate_in_stages_of_their_own_or_with_whole_weights(kit):
    """A pipelined actor (p2t2d1 on d0-3) generates as a pipeline where the call's layout has
    its pipeline stages (p2t2d1 on its training weights, p2t1d2 through the hybrid engine's
    switch in each stage), with whole weights where the call's is p1t1d4; other layouts are
    refused with the call, so a runnable search keeps away from them."""
    d03 = DeviceRange(0, 4)
    plan = ExecutionPlan({c.name: (d03, Mesh(1, 1, 4)) for c in PPO_FLOW.calls})
    for call in ("gen", "old_log_prob", "update_actor"):
        plan.layouts[call] = (d03, Mesh(2, 2, 1))
    actor = {s.role: s for s in plan_groups(plan, PPO_FLOW, kit["workers"])}["actor"]
    assert actor.layout == Mesh(2, 2, 1) and actor.calls == ["gen", "old_log_prob", "update_actor"]
    plan.layouts["gen"] = (d03, Mesh(1, 1, 4))
    actor = {s.role: s for s in plan_groups(plan, PPO_FLOW, kit["workers"])}["actor"]
    assert (actor.layout.gen_pp, actor.layout.gen_tp) == (1, 1)
    plan.layouts["gen"] = (d03, Mesh(2, 1, 2))
    actor = {s.role: s for s in plan_groups(plan, PPO_FLOW, kit["workers"])}["actor"]
    assert (actor.layout.gen_pp, actor.layout.gen_tp, actor.layout.transition) == (2, 1, "hybridflow")
    plan.layouts["gen"] = (d03, Mesh(1, 2, 2))
    with pytest.raises(PlannerError, match=r"'gen' of model 'actor' .*stages of their own \(p2t2d1 or p2 .*p1t1d4"):
        plan_groups(plan, PPO_FLOW, kit["workers"])
    assert runtime_refusal(plan, PPO_FLOW) is not None
