"""Reusing the rollout's log-probs as log pi_old (AlgoConfig.old_log_probs): the same loss and
gradients as recomputing them where it is on, refused where it would be wrong."""

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from algorithms import GRPO, PPO, Groups, GRPOConfig, PPOConfig, core
from algorithms.losses import ActorLoss
from workbench import Batch
from workbench.data import arithmetic
from workbench.data.prompts import tokenize_prompts
from workbench.engines.forward import model_outputs, response_log_probs
from workbench.engines.hf_rollout import HFRollout
from workbench.engines.rollout import SamplingConfig
from workbench.models import load, make_tiny
from workbench.workers import ActorConfig, ActorRolloutRefWorker
from workbench.workers.rule_reward import RuleReward

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "tests"


@pytest.fixture(scope="module")
def model_dir():
    return make_tiny("1m", CACHE / "tiny-1m")


def prompts_for(tokenizer, count=4):
    problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), count, seed=3)
    return tokenize_prompts([p.__dict__ for p in problems], tokenizer, max_prompt_length=16)


def sampled(model_dir):
    """The tiny model, a batch it sampled (random advantages), the sampling, and log pi_old of
    the batch recomputed by a training forward."""
    torch.manual_seed(0)
    loaded = load(model_dir)
    model = loaded.model
    rollout = HFRollout(model, loaded.tokenizer.pad_token_id, loaded.tokenizer.eos_token_id)
    sampling = SamplingConfig(max_new_tokens=8, n=2, temperature=0.9, seed=1)
    batch = rollout.generate(prompts_for(loaded.tokenizer), sampling)
    batch["advantages"] = torch.randn(batch["responses"].shape) * batch["response_mask"]
    with torch.no_grad():
        recomputed, _ = response_log_probs(model, batch, sampling.temperature)
    return model, batch, sampling, recomputed


def test_loss_and_gradients_equal_recomputation(model_dir):
    model, batch, sampling, recomputed = sampled(model_dir)
    mask = batch["response_mask"].bool()
    assert (recomputed - batch["rollout_log_probs"])[mask].abs().max() < 1e-5

    loss = ActorLoss(policy=core.POLICY_LOSSES.get("ppo"), temperature=sampling.temperature)
    results = []
    for old in (recomputed, batch["rollout_log_probs"]):
        batch["old_log_probs"] = old
        model.zero_grad()
        value, metrics = loss(model_outputs(model.train(), batch, loss.needs, loss.temperature), batch)
        value.backward()
        results.append((value.item(), [p.grad.clone() for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, abs=1e-6)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("correction", [None, "tis", "decoupled"])
def test_pi_old_from_the_update_equals_recomputation(model_dir, correction):
    """old_log_probs="update": the loss fills pi_old from its own forward; on rows of an older
    policy (behaviour log-probs off by a perturbation) the loss, gradients and the correction's
    weights equal those with pi_old recomputed beforehand."""
    model, batch, sampling, recomputed = sampled(model_dir)
    batch["rollout_log_probs"] = batch["rollout_log_probs"] + 0.3 * torch.randn(batch["responses"].shape)
    settings = {"is_cap": 2.0}
    fix = core.OFF_POLICY_CORRECTIONS.get(correction) if correction else None
    results = []
    for from_update in (False, True):
        loss = ActorLoss(
            core.POLICY_LOSSES.get("ppo"),
            settings,
            sampling.temperature,
            correction=fix,
            pi_old_from_update=from_update,
        )
        rows = batch if from_update else batch.union(Batch({"old_log_probs": recomputed}))
        model.zero_grad()
        value, metrics = loss(model_outputs(model.train(), rows, loss.needs, loss.temperature), rows)
        value.backward()
        results.append((value.item(), metrics, [p.grad.clone() for p in model.parameters()]))
    (loss_a, metrics_a, grads_a), (loss_b, metrics_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, abs=1e-6)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    for key, value in metrics_a.items():  # the correction's weights and caps, the clip fraction
        assert metrics_b[key] == pytest.approx(value, abs=1e-5), key
    assert metrics_b["actor/rollout_logprob_diff"] > 0.1  # the behaviour policy's gap, measured in the loss


def algorithm_with(model_dir, algo=GRPO, config=None, **actor):
    actor_config = ActorConfig(model_path=str(model_dir), **actor)
    groups = Groups(
        actor=SimpleNamespace(config=actor_config),
        reference=SimpleNamespace(config=actor_config),
        critic=object(),
        reward=object(),
    )
    return algo(groups, config or algo.Config())


def test_auto_reuses_only_where_exact(model_dir):
    assert algorithm_with(model_dir, mini_batch_size=16).old_log_prob_source(16) == "rollout"
    assert algorithm_with(model_dir, mini_batch_size=8).old_log_prob_source(16) == "recompute"
    assert algorithm_with(model_dir, mini_batch_size=16, epochs=2).old_log_prob_source(16) == "recompute"
    recompute = PPOConfig(old_log_probs="recompute")
    assert algorithm_with(model_dir, PPO, recompute, mini_batch_size=16).old_log_prob_source(16) == "recompute"


def test_auto_takes_pi_old_from_the_update_where_the_rollouts_differ(model_dir):
    # Other numerics (vLLM), an older policy's rows or an off-policy correction: a one-step
    # update's own forward gives pi_old, so no separate forward runs.
    assert algorithm_with(model_dir, mini_batch_size=16, rollout="vllm").old_log_prob_source(16) == "update"
    assert algorithm_with(model_dir, mini_batch_size=16).old_log_prob_source(16, stale=True) == "update"
    tis = GRPOConfig(off_policy_correction="tis")
    assert algorithm_with(model_dir, GRPO, tis, mini_batch_size=16).old_log_prob_source(16) == "update"
    # ... but not where the update takes several steps, or the driver reads pi_old (a KL reward).
    assert algorithm_with(model_dir, mini_batch_size=8).old_log_prob_source(16, stale=True) == "recompute"
    kl_reward = PPOConfig(kl_coef=0.05)
    assert algorithm_with(model_dir, PPO, kl_reward, mini_batch_size=16).old_log_prob_source(16, True) == "recompute"


def test_update_is_refused_where_it_would_not_be_pi_old(model_dir):
    config = PPOConfig(old_log_probs="update", kl_coef=0.0)
    assert algorithm_with(model_dir, PPO, config, mini_batch_size=16).old_log_prob_source(16) == "update"
    with pytest.raises(ValueError, match=r"'update' .* ActorConfig.epochs=2 .*\(epochs=1, mini_batch_size >= 16"):
        algorithm_with(model_dir, PPO, config, mini_batch_size=16, epochs=2).old_log_prob_source(16)
    with pytest.raises(ValueError, match=r"'update' .* kl_coef > 0 puts pi_old in the reward"):
        algorithm_with(
            model_dir, PPO, PPOConfig(old_log_probs="update", kl_coef=0.1), mini_batch_size=16
        ).old_log_prob_source(16)
    with pytest.raises(ValueError, match=r"'rollout' .* generated by an older policy"):
        algorithm_with(model_dir, PPO, PPOConfig(old_log_probs="rollout"), mini_batch_size=16).old_log_prob_source(
            16, True
        )


def test_rollout_is_refused_for_multi_epoch_or_multi_step_updates(model_dir):
    config = PPOConfig(old_log_probs="rollout")
    with pytest.raises(ValueError, match=r"ActorConfig.epochs=2 .* old_log_probs='recompute'"):
        algorithm_with(model_dir, PPO, config, mini_batch_size=16, epochs=2).old_log_prob_source(16)
    with pytest.raises(ValueError, match=r"mini_batch_size=4 splits the 16 rows"):
        algorithm_with(model_dir, PPO, config, mini_batch_size=4).old_log_prob_source(16)
    with pytest.raises(ValueError, match=r"old_log_probs='sometimes'"):
        PPOConfig(old_log_probs="sometimes")


def test_an_on_policy_step_skips_the_recomputing_forward(session, model_dir):
    tokenizer = load(model_dir).tokenizer
    actor = session.group(
        "actor",
        ActorRolloutRefWorker,
        session.pool("actor_pool", 1),
        ActorConfig(model_path=str(model_dir), mini_batch_size=8, micro_batch_size=8),
    )
    grpo = GRPO(
        Groups(actor=actor, reward=RuleReward(arithmetic.score)),
        GRPOConfig(sampling=SamplingConfig(max_new_tokens=4, n=2), kl_loss_coef=0.0),
    )
    since = time.time()  # the session's trace holds every earlier test's spans too
    batch, metrics = grpo.step(prompts_for(tokenizer))
    methods = {r.method for r in session.trace() if r.role == "actor" and r.start >= since}
    assert "compute_log_prob" not in methods and "update_actor" in methods
    assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
    assert "timing_s/old_log_prob" not in metrics
    # Recompute on request: the forward runs again.
    grpo.config.old_log_probs = "recompute"
    since = time.time()
    grpo.step(prompts_for(tokenizer))
    assert "compute_log_prob" in {r.method for r in session.trace() if r.role == "actor" and r.start >= since}
