"""Asynchronous RL on real worker groups (tiny kit, shared Ray): the actor trains on one pool, a
rollout group generates on another, weights pass through a real gloo weight channel."""

import sys
import time

import pytest
import ray
import torch

from algorithms import GRPO, Groups, GRPOConfig
from tests.kit import checksum_score
from workbench.data import arithmetic
from workbench.data.prompts import tokenize_prompts
from workbench.engines.contract import OptimConfig
from workbench.engines.rollout import SamplingConfig
from workbench.engines.vllm_rollout import VLLMRolloutConfig
from workbench.errors import ConfigError
from workbench.models import load, make_tiny
from workbench.models.lora import LoRAConfig
from workbench.run.checkpoint import RunCheckpointer
from workbench.workers import ActorConfig, ActorRolloutRefWorker
from workbench.workers.rollout_link import RolloutLink, reallocatable
from workbench.workers.rule_reward import RuleReward

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SAMPLING = SamplingConfig(max_new_tokens=6, n=2, seed=0)


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    model_dir = make_tiny("1m", tmp_path_factory.mktemp("async") / "policy", seed=5)
    tokenizer = load(model_dir).tokenizer
    problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), 16, seed=1)
    prompts = tokenize_prompts([p.__dict__ for p in problems], tokenizer, max_prompt_length=32)
    return {"model": str(model_dir), "batches": [prompts[i : i + 4] for i in range(0, 16, 4)]}


@pytest.fixture(scope="module")
def session(shared_session):
    yield shared_session
    shared_session.clear()


def actor_config(model, **changes):
    values = dict(model_path=model, optim=OptimConfig(lr=1e-3), mini_batch_size=8, micro_batch_size=4)
    return ActorConfig(**{**values, **changes})


def split_pair(session, model):
    """A fresh trainer (no rollout engine) on one pool and a rollout group on another (re-created
    under the same names, so every test starts from the initial weights)."""
    trainer = session.group(
        "async_trainer", ActorRolloutRefWorker, session.pool("async_train", 1), actor_config(model, rollout=None)
    )
    rollout = session.group(
        "async_rollout", ActorRolloutRefWorker, session.pool("async_gen", 1), actor_config(model, train=False)
    )
    return trainer, rollout


def distinct(text: str, truth: str) -> float:
    """Scores apart any two different texts: tests.kit.checksum_score."""
    return checksum_score(text)


def grpo(trainer, rollout=None, **config):
    config = GRPOConfig(sampling=SAMPLING, kl_loss_coef=0.0, **config)
    return GRPO(Groups(actor=trainer, rollout=rollout, reward=RuleReward(distinct)), config)


def learned(metrics):
    """What a run computed, without its clocks (and the pipeline's own counters)."""
    return [{k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/", "async/"))} for m in metrics]


@pytest.mark.numerics
def test_staleness_zero_is_the_synchronous_colocated_run_bit_exactly(session, kit, tmp_path):
    # The colocated actor (its own HF rollout) in the trainer's role and pool: split_pair then
    # starts the trainer on its warm process instead of a new one.
    colocated = session.group(
        "async_trainer", ActorRolloutRefWorker, session.pool("async_train", 1), actor_config(kit["model"])
    )
    reference = grpo(colocated).fit(kit["batches"], 2, log=None)
    # It learned (so the equalities below are not two runs that did nothing): every update had a
    # gradient, and the weights differ from the initial model's.
    assert all(m["actor/grad_norm"] > 0 for m in reference)
    trained = load(colocated.export_hf(str(tmp_path / "trained")).get()[0]).model.state_dict()
    initial = load(kit["model"]).model.state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)

    # Asynchronous with staleness 0, the rollout group reallocated into (every actor rank a
    # source, a layer unit at a time): the same run. Two iterations: the second generates from
    # the weights pushed after the first update.
    since = time.time()
    reallocated = grpo(*split_pair(session, kit["model"]), rollout_weights="reallocate").fit(
        kit["batches"], 2, log=None, asynchronous=True, max_staleness=0
    )
    assert [m["async/staleness_max"] for m in reallocated] == [0.0] * 2
    assert learned(reallocated) == learned(reference)
    spans = [r for r in session.trace() if r.start >= since]
    pids = {r.pid for r in spans if r.method in ("generate_sequences", "update_actor")}  # this run's processes
    sent = [r for r in spans if r.method == "async.send_weights" and r.pid in pids]
    received = [r for r in spans if r.method == "async.receive_weights" and r.pid in pids]
    model_bytes = sum(t.numel() * t.element_size() for t in load(kit["model"]).model.state_dict().values())
    assert len(sent) >= 2 and len(received) >= 2  # the push after the last update may still run
    assert all(r.extra["bytes_sent"] == model_bytes and r.extra["layers"] > 2 for r in sent)
    assert all(r.extra["bytes_received"] == model_bytes and r.extra["layers"] > 2 for r in received)

    # Broadcast to instead (after the spans above: its pushes run in the same processes): the same run.
    pipelined = grpo(*split_pair(session, kit["model"])).fit(
        kit["batches"], 2, log=None, asynchronous=True, max_staleness=0
    )
    assert [m["async/staleness_max"] for m in pipelined] == [0.0] * 2
    assert learned(pipelined) == learned(reference)


def test_generation_runs_ahead_within_the_staleness_bound(session, kit):
    ahead: dict[int, list] = {}
    for bound in (1, 2):
        trainer, rollout = split_pair(session, kit["model"])
        metrics = ahead[bound] = grpo(trainer, rollout, off_policy_correction="tis").fit(
            kit["batches"], 3, log=None, asynchronous=True, max_staleness=bound
        )
        stale = [m["async/staleness_max"] for m in metrics]  # from the rows' policy_version column
        assert max(stale) == bound, stale  # it ran ahead, and never further than the bound
        assert all(m["actor/is_weight_mean"] > 0 for m in metrics)  # pi_old weighed against the rows'
    spans = session.trace()
    # A one-step update takes pi_old from its own forward ("auto" -> "update"): no separate
    # forward ran, and the run equals one that recomputed pi_old beforehand.
    assert not [r for r in spans if r.role == "async_trainer" and r.method == "compute_log_prob"]
    trainer, rollout = split_pair(session, kit["model"])
    recomputed = grpo(trainer, rollout, off_policy_correction="tis", old_log_probs="recompute").fit(
        kit["batches"], 3, log=None, asynchronous=True, max_staleness=2
    )
    assert [r for r in session.trace() if r.role == "async_trainer" and r.method == "compute_log_prob"]
    for fused, separate in zip(learned(metrics), learned(recomputed)):
        assert fused.keys() == separate.keys()
        for key, value in fused.items():
            assert separate[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    sends = [r for r in spans if r.method == "async.send_weights" and r.rank == 0]
    received = [r for r in spans if r.method == "async.receive_weights"]
    assert sends and received
    assert received[-1].extra["bytes_received"] * 1 == sends[-1].extra["bytes_sent"] > 0
    assert received[-1].extra["tensors"] == sends[-1].extra["tensors"]
    gens = [r for r in spans if r.role == "async_rollout" and r.method == "generate_sequences"]
    updates = [r for r in spans if r.role == "async_trainer" and r.method == "update_actor"]
    overlap = sum(max(0.0, min(g.end, u.end) - max(g.start, u.start)) for g in gens for u in updates)
    assert overlap > 0  # the rollout generated while the actor trained

    # The rollout on the trainer's own device: the weight link's calls run as joint calls (over
    # gloo), the two groups take turns there, and the run learns what the run apart learned.
    since = time.time()
    train_pool = session.pool("async_train", 1)
    trainer = session.group(
        "async_trainer", ActorRolloutRefWorker, train_pool, actor_config(kit["model"], rollout=None)
    )
    rollout = session.group("async_rollout", ActorRolloutRefWorker, train_pool, actor_config(kit["model"], train=False))
    shared = grpo(trainer, rollout, off_policy_correction="tis").fit(
        kit["batches"], 3, log=None, asynchronous=True, max_staleness=1
    )
    assert learned(shared) == learned(ahead[1])
    spans = [r for r in session.trace() if r.start >= since and "." not in r.method]
    joint = ("send_weights", "receive_weights", "join_weight_channel")
    gens = [r for r in spans if r.role == "async_rollout" and r.method not in joint]
    trains = [r for r in spans if r.role == "async_trainer" and r.method not in joint]
    assert gens and trains
    for g in gens:  # one device: the two groups' calls never run at once
        assert all(t.end <= g.start + 1e-3 or t.start >= g.end - 1e-3 for t in trains), g


def test_a_checkpoint_mid_pipeline_resumes_to_the_same_metrics(session, kit, tmp_path):
    trainer, rollout = split_pair(session, kit["model"])
    algo = grpo(trainer, rollout)
    algo.fit(kit["batches"], 2, log=None, asynchronous=True, max_staleness=2)
    checkpoints = RunCheckpointer(tmp_path)
    checkpoints.save(algo)
    assert [r.version for r in algo.rollouts.queue] == [0, 1]  # generated ahead, saved with their versions
    straight = learned(algo.fit(kit["batches"], 3, log=None, asynchronous=True, max_staleness=2))
    resumed_algo = grpo(trainer, rollout)
    checkpoints.restore(resumed_algo)
    resumed = learned(resumed_algo.fit(kit["batches"], 3, log=None, asynchronous=True, max_staleness=2))
    assert resumed == straight


def test_a_background_fit_runs_the_pipeline_and_feeds_the_live_views(session, kit):
    from widgets import LiveTimeline, MetricsDashboard

    trainer, rollout = split_pair(session, kit["model"])
    dashboard, timeline = MetricsDashboard(), LiveTimeline(session, since=time.time())
    background = grpo(trainer, rollout).fit_background(
        kit["batches"], 3, [dashboard, timeline], asynchronous=True, max_staleness=1
    )
    metrics = background.wait(timeout=120)
    assert [m["async/staleness_max"] for m in metrics][1:] == [1.0, 1.0]  # it ran ahead in the thread
    assert len(dashboard.history) == 3
    timeline.refresh()
    roles = {r.role for r in timeline.records}
    assert {"async_trainer", "async_rollout"} <= roles  # the timeline shows both pools


def test_refusals_name_the_role_and_the_fix(session, kit):
    trainer, rollout = split_pair(session, kit["model"])
    with pytest.raises(ValueError, match="rollout group"):
        grpo(trainer).fit(kit["batches"], 1, log=None, asynchronous=True)
    with pytest.raises(ConfigError, match="max_staleness"):
        grpo(trainer, rollout).fit(kit["batches"], 1, log=None, asynchronous=True, max_staleness=-1)
    with pytest.raises(ConfigError, match="train=False"):
        grpo(trainer, trainer).step(kit["batches"][0])
    with pytest.raises(ConfigError, match=r"rollout_weights.*'broadcast' or 'reallocate'"):
        grpo(trainer, rollout, rollout_weights="scatter")
    # reallocation moves whole weights out of an FSDP engine: not LoRA's adapters, not DeepSpeed's
    lora = actor_config(kit["model"], rollout=None, lora=LoRAConfig(rank=4))
    assert reallocatable(trainer.config, rollout.config)
    assert not reallocatable(lora, rollout.config)
    assert not reallocatable(actor_config(kit["model"], rollout=None, backend="deepspeed"), rollout.config)
    assert not reallocatable(trainer.config, trainer.config)  # no rollout engine to load into
    assert reallocatable(trainer.config, actor_config(kit["model"], train=False, rollout="vllm"))
    with pytest.raises(ValueError, match=r"old_log_probs='rollout' .* max_staleness=1 .*old_log_probs='auto'"):
        grpo(trainer, rollout, old_log_probs="rollout").fit(kit["batches"], 1, log=None, asynchronous=True)
    # A group holds one weight channel: a link replaced by a newer one refuses to push (it would hang).
    first, newer = RolloutLink(trainer, rollout), RolloutLink(trainer, rollout)
    with pytest.raises(ConfigError, match=r"WeightLink.push.*a newer link joined"):
        first.push(1)
    newer.push(1)
    assert len(newer.check()) == 2


# Last in the module: a process that loaded vLLM is never kept warm, so the rollout process it
# takes over serves the tests above first.
def test_a_vllm_rollout_group_reallocated_into_runs_as_one_broadcast_to(session, kit):
    """vLLM engines keep the reallocated units and reload the model once all have arrived: the
    same weights as a broadcast brings, so the same run (vLLM's seeded sampling), each push one
    model's bytes in several layer units. One engine serves both runs: a run's first push loads
    the fresh trainer's initial weights over those the run before left there."""
    rollout = session.group(
        "async_rollout",
        ActorRolloutRefWorker,
        session.pool("async_gen", 1),
        actor_config(kit["model"], train=False, rollout="vllm", vllm=VLLMRolloutConfig(max_model_len=128)),
    )
    runs = {}
    for weights in ("broadcast", "reallocate"):
        trainer = session.group(
            "async_trainer",
            ActorRolloutRefWorker,
            session.pool("async_train", 1),
            actor_config(kit["model"], rollout=None),
        )
        since = time.time()
        runs[weights] = grpo(trainer, rollout, rollout_weights=weights).fit(
            kit["batches"][:2], 2, log=None, asynchronous=True, max_staleness=0
        )
    assert learned(runs["reallocate"]) == learned(runs["broadcast"])
    assert all(m["actor/grad_norm"] > 0 for m in runs["reallocate"])  # each update moved the weights
    # Each batch was generated from the pushed weights: the engine's log-probs are the trainer's,
    # the initial ones (not the broadcast run's last) and then the updated ones (an engine left
    # with other weights would be far off).
    assert all(m["actor/rollout_logprob_diff"] <= 1e-4 for m in runs["reallocate"])
    pids = {r.pid for r in session.trace() if r.start >= since and r.method == "update_actor"}
    sent = [r for r in session.trace() if r.start >= since and r.method == "async.send_weights" and r.pid in pids]
    model_bytes = sum(t.numel() * t.element_size() for t in load(kit["model"]).model.state_dict().values())
    assert sent and all(r.extra["bytes_sent"] == model_bytes and r.extra["layers"] > 2 for r in sent)
