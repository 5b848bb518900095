"""Pipeline-parallel workers in a Session: an actor (training, reference and an HF rollout with
whole weights on every rank) and a critic on Mesh(pp=2), backend "3d". Their scoring forwards
and an update equal the same in one process; generation picks up the update (the weight sync
gathers every stage); a checkpoint round-trips. An actor generating as a pipeline (gen_pp = pp)
samples what one process samples, reads its updates live, and switches to whole weights and
back on live processes; trained p2t2, it generates p2t1 through the hybrid engine's switch
inside each stage; the layouts and settings it cannot run are refused on the driver."""

from dataclasses import replace

import pytest
import ray
import torch

import tests.workers.losses as losses
from algorithms.losses import CriticLoss
from tests.hybrid.test_hybrid_engine import GREEDY, OPTIM, single_process_step
from tests.workers.reference import advantages_for, assert_checkpoint_roundtrip, prompts
from workbench import Batch, Mesh
from workbench.engines.forward import model_outputs, response_values
from workbench.engines.hf_rollout import HFRollout, HFRolloutConfig
from workbench.engines.rollout import SamplingConfig, end_token_ids, stream_seed
from workbench.engines.tensor_parallel import TensorParallelEngine
from workbench.errors import ConfigError
from workbench.models import LoadConfig, load, make_tiny
from workbench.models.value import load_value_model
from workbench.workers import ActorConfig, ActorRolloutRefWorker
from workbench.workers.critic import CriticConfig, CriticWorker

ray.cloudpickle.register_pickle_by_value(losses)

MESH = Mesh(pp=2, gen_pp=1, gen_tp=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny("1m", tmp_path_factory.mktemp("tiny") / "actor", seed=5))


def actor_config(model_dir, **kw) -> ActorConfig:
    kw = {"reference": True, **kw}
    return ActorConfig(model_path=model_dir, backend="3d", optim=OPTIM, mini_batch_size=8, micro_batch_size=2, **kw)


@pytest.mark.timeout(300)
def test_a_pipelined_actor_scores_updates_and_generates_like_one_process(session, model_dir, tmp_path):
    actor = session.group(
        "actor", ActorRolloutRefWorker, session.pool("actor_pool", 2), actor_config(model_dir), mesh=MESH
    )
    loaded = load(model_dir)
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    batch = prompts(tokenizer, 8)
    rolled = actor.generate_sequences(batch, SamplingConfig(max_new_tokens=8, n=1, seed=3)).get()
    scored = actor.compute_log_prob(rolled).get()
    with torch.no_grad():
        want = model_outputs(model, rolled)["log_probs"]
    assert (scored["old_log_probs"] - want).abs().max() <= 1e-5
    ref = actor.compute_ref_log_prob(rolled).get()["ref_log_probs"]
    assert (ref - want).abs().max() <= 1e-5

    train = rolled.union(advantages_for(rolled))
    metrics = actor.update_actor(train, losses.reinforce_loss).get()
    assert metrics["actor/grad_norm"] > 0
    single = single_process_step(model, train, dp=1)
    trained = load(actor.export_hf(str(tmp_path / "hf")).get()[0]).model.state_dict()
    worst = max((trained[k] - v).abs().max().item() for k, v in single.state_dict().items())
    assert worst <= 1e-5, f"pp=2 vs single process: max param diff {worst}"

    after = actor.generate_sequences(batch, GREEDY).get()  # the rollout's copy got every stage's update
    mask = after["response_mask"].bool()
    with torch.no_grad():
        new, old = (model_outputs(m, after)["log_probs"] for m in (single, model))
    to_new, to_old = ((after["rollout_log_probs"] - x).abs()[mask].max() for x in (new, old))
    assert to_new <= 1e-4 and to_old > 20 * to_new, f"generation did not pick up the update: {to_new} vs {to_old}"
    assert_checkpoint_roundtrip(actor, train, tmp_path / "ckpt")


@pytest.mark.timeout(300)
def test_a_pipelined_critic_scores_and_updates_like_one_process(session, model_dir):
    cfg = CriticConfig(model_path=model_dir, backend="3d", optim=OPTIM, mini_batch_size=8, micro_batch_size=2)
    critic = session.group("critic", CriticWorker, session.pool("critic_pool", 2), cfg, mesh=Mesh(pp=2))
    loaded = load(model_dir)
    engine = HFRollout(loaded.model, loaded.tokenizer.pad_token_id, loaded.tokenizer.eos_token_id)
    rolled = engine.generate(prompts(loaded.tokenizer, 8), SamplingConfig(max_new_tokens=6, seed=0))
    torch.manual_seed(cfg.seed)  # the score head is new: initialised as the workers' were
    single = TensorParallelEngine(load_value_model(model_dir).model, OPTIM, None)
    values = critic.compute_values(rolled).get()["values"]
    with torch.no_grad():
        want = response_values(single.model.eval(), rolled)
    assert (values - want).abs().max() <= 1e-5
    train = rolled.union(Batch({"values": values, "returns": torch.ones_like(values)}))
    got = critic.update_critic(train, CriticLoss()).get()
    forward = lambda model, mb: model_outputs(model, mb, ("values",))  # noqa: E731
    expected = single.train_step(CriticLoss(), [train[i : i + 2] for i in range(0, 8, 2)], forward)
    assert abs(got["critic/vf_loss"] - expected["critic/vf_loss"]) <= 1e-5
    assert abs(got["critic/grad_norm"] - expected["grad_norm"]) <= 1e-5
    after = critic.compute_values(rolled).get()["values"]
    with torch.no_grad():
        assert (after - response_values(single.model.eval(), rolled)).abs().max() <= 1e-5


@pytest.mark.timeout(300)
def test_pipeline_stages_generate_as_one_process_does_and_switch_to_whole_weights(session, model_dir):
    pipelined = Mesh(pp=2)  # generates in its training layout by default
    # Checkpointed layers drop the KV cache in train mode: generation must run in eval mode
    # after an update too.
    checkpointed = LoadConfig(gradient_checkpointing=True)
    actor = session.group(
        "pipelined_actor",
        ActorRolloutRefWorker,
        session.pool("pipelined_pool", 2),
        actor_config(model_dir, reference=False, load=checkpointed),
        mesh=pipelined,
    )
    loaded = load(model_dir)
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    one = HFRollout(model, tokenizer.pad_token_id, end_token_ids(model, tokenizer))
    batch = prompts(tokenizer, 8)
    sampled = SamplingConfig(max_new_tokens=8, n=2, seed=3)  # n=2: the stages share each prompt's cache
    got = actor.generate_sequences(batch, sampled).get()
    want = one.generate(batch, replace(sampled, seed=stream_seed(3, 0)))  # generation replica 0's stream
    assert torch.equal(got["responses"], want["responses"])
    assert (got["rollout_log_probs"] - want["rollout_log_probs"]).abs().max() <= 1e-5

    rolled = got[:8]
    train = rolled.union(advantages_for(rolled))
    actor.update_actor(train, losses.reinforce_loss).get()
    single = single_process_step(model, train, dp=1)
    after = actor.generate_sequences(batch, GREEDY).get()  # the stages' live weights: nothing synced
    mask = after["response_mask"].bool()
    with torch.no_grad():
        new, old = (model_outputs(m, after)["log_probs"] for m in (single, model))
    to_new, to_old = ((after["rollout_log_probs"] - x).abs()[mask].max() for x in (new, old))
    assert to_new <= 1e-4 and to_old > 20 * to_new, f"generation did not read the update: {to_new} vs {to_old}"
    spans = {r.method for r in session.trace() if r.role == "pipelined_actor"}
    assert "generate_sequences" in spans and "hybrid.sync_weights" not in spans  # no copy to fill

    assert actor.switch_generation(gen_pp=1, gen_tp=1) == MESH  # a whole copy on each rank, gathered
    whole = actor.generate_sequences(batch, GREEDY).get()
    actor.switch_generation(gen_pp=2, gen_tp=1)
    again = actor.generate_sequences(batch, GREEDY).get()
    for other in (whole, again):
        assert torch.equal(other["responses"], after["responses"])
        assert (other["rollout_log_probs"] - after["rollout_log_probs"]).abs().max() <= 1e-5


def test_pipeline_generation_layouts_it_cannot_run_are_refused(model_dir):
    actor_config(model_dir).check_layout(Mesh(pp=2), "actor")  # pipelined: runs
    actor_config(model_dir).check_layout(MESH, "actor")  # whole weights: runs
    actor_config(model_dir).check_layout(Mesh(pp=2, tp=2, gen_tp=1, transition="hybridflow"), "actor")  # switched
    with pytest.raises(ConfigError, match=r"gen_pp=1, gen_tp=1"):
        actor_config(model_dir).check_layout(Mesh(pp=4, gen_pp=2), "actor")
    with pytest.raises(ConfigError, match=r"inside each stage with transition='hybridflow'"):
        actor_config(model_dir).check_layout(Mesh(pp=2, tp=2, gen_tp=1, transition="vanilla"), "actor")
    with pytest.raises(ConfigError, match=r"ActorConfig.rollout.*HF rollout"):
        actor_config(model_dir, rollout="vllm").check_layout(Mesh(pp=2), "actor")
    with pytest.raises(ConfigError, match=r"ActorConfig.train.*whole weights"):
        actor_config(model_dir, train=False).check_layout(Mesh(pp=2), "actor")
    with pytest.raises(ConfigError, match=r"ActorConfig.hf.*dynamic KV cache"):
        actor_config(model_dir, hf=HFRolloutConfig(cache="static")).check_layout(Mesh(pp=2), "actor")
    with pytest.raises(ConfigError, match=r"num_hidden_layers.*pp=3"):
        actor_config(model_dir, rollout=None).check_layout(Mesh(pp=3), "actor")


@pytest.mark.timeout(300)
def test_stages_switch_to_a_smaller_tensor_layout_each_and_generate_as_a_pipeline(session, model_dir):
    """p2t2 training, p2t1 generation: each stage's hybridflow switch inside its tensor-parallel
    group (two generation pipelines per training replica), checked by the weight-sync checksum."""
    actor = session.group(
        "staged_actor",
        ActorRolloutRefWorker,
        session.pool("staged_pool", 4),
        actor_config(model_dir, reference=False),
        mesh=Mesh(pp=2, tp=2, gen_tp=1, transition="hybridflow"),
    )
    loaded = load(model_dir)
    model, tokenizer = loaded.model.eval(), loaded.tokenizer
    one = HFRollout(model, tokenizer.pad_token_id, end_token_ids(model, tokenizer))
    batch = prompts(tokenizer, 8)
    first = actor.generate_sequences(batch, GREEDY).get()
    want = one.generate(batch, GREEDY)
    assert torch.equal(first["responses"], want["responses"])
    assert (first["rollout_log_probs"] - want["rollout_log_probs"]).abs().max() <= 1e-5
    switches = [r.extra for r in session.trace() if r.role == "staged_actor" and r.method == "hybrid.transition"]
    assert len(switches) == 4 and all(s["checked"] and s["executor"] == "allgather" for s in switches)
    assert all(s["bytes_received"] > 0 for s in switches)  # each rank gathered its stage's other half

    train = first.union(advantages_for(first))
    # Replay (workbench.workers.replay): the update taken twice on stages cut tensor-parallel,
    # measured and rewound. Its norm is the single-process step's, each piece counted once.
    digest = actor.state_digest().get()
    replayed = actor.replay_update(train, {"a": losses.reinforce_loss, "b": losses.reinforce_loss}).get()
    assert actor.state_digest().get() == digest
    update = actor.update_actor(train, losses.reinforce_loss).get()
    assert replayed["metrics"]["a"] == replayed["metrics"]["b"] == update  # loss and gradient norm, exactly
    single = single_process_step(model, train, dp=1)
    moved = sum(
        float((a.detach().double() - b.detach().double()).pow(2).sum())
        for a, b in zip(single.parameters(), model.parameters())
    )
    (aa, ab), (_, bb) = replayed["dots"]
    assert aa == ab == bb and abs(aa - moved) <= 1e-4 * moved, (aa, moved)
    after = actor.generate_sequences(batch, GREEDY).get()
    mask = after["response_mask"].bool()
    with torch.no_grad():
        new, old = (model_outputs(m, after)["log_probs"] for m in (single, model))
    to_new, to_old = ((after["rollout_log_probs"] - x).abs()[mask].max() for x in (new, old))
    assert to_new <= 1e-4 and to_old > 20 * to_new, f"the switch did not carry the update: {to_new} vs {to_old}"
    for changes in ({"gen_tp": 2}, {"gen_pp": 1, "gen_tp": 1}, {"gen_pp": 2, "gen_tp": 1}):  # live processes
        actor.switch_generation(**changes)
        again = actor.generate_sequences(batch, GREEDY).get()
        assert torch.equal(again["responses"], after["responses"]), changes
        assert (again["rollout_log_probs"] - after["rollout_log_probs"]).abs().max() <= 1e-5, changes

    # An in-memory snapshot of stages cut tensor-parallel (each rank holds its own pieces and
    # Adam moments): a second update, rewound and taken again, lands on the same bits.
    actor.snapshot("p2t2").get()
    before = actor.state_digest().get()
    second = actor.update_actor(train, losses.reinforce_loss).get()
    moved = actor.state_digest().get()
    actor.restore_snapshot("p2t2").get()
    assert actor.state_digest().get() == before and all(a != b for a, b in zip(before, moved))
    updated = actor.update_actor(train, losses.reinforce_loss).get()
    assert "actor/grad_norm" in second and updated == second  # loss terms and gradient norm, exactly
    assert actor.state_digest().get() == moved
