"""Every algorithm, two iterations end to end on real worker groups (tiny kit, shared Ray):
actor + reference (FSDP2, HF rollout) on 2 devices, critics, a reward model and a cost model
fused in one process on a third, and rule rewards in Ray tasks."""

import dataclasses
import math
import sys

import pytest
import ray
import torch

import algorithms
from algorithms import GRPO, Groups, GRPOConfig, core
from workbench.data import arithmetic
from workbench.data.prompts import tokenize_prompts
from workbench.engines.contract import OptimConfig
from workbench.engines.rollout import SamplingConfig
from workbench.errors import WorkbenchError
from workbench.models import load, make_tiny
from workbench.models.value import load_value_model
from workbench.stages import text_batch
from workbench.workers import ActorConfig, ActorRolloutRefWorker
from workbench.workers.critic import CriticConfig, CriticWorker
from workbench.workers.reward import CostModelWorker, RewardModelWorker, ScoreModelConfig
from workbench.workers.rule_reward import RuleReward

# Functions defined here travel to the workers by value, as a notebook's would.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

SAMPLING = SamplingConfig(max_new_tokens=6, n=2, seed=0)


def rule_cost(text: str, truth: str) -> float:
    return arithmetic.cost(text)


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    root = tmp_path_factory.mktemp("algos")
    model_dir = make_tiny("1m", root / "policy", seed=5)
    scorer = load_value_model(model_dir)  # a value model with a fixed (random) head
    scorer.model.save_pretrained(root / "scorer")
    scorer.tokenizer.save_pretrained(root / "scorer")
    tokenizer = load(model_dir).tokenizer
    problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), 4, seed=1)
    prompts = tokenize_prompts([p.__dict__ for p in problems], tokenizer, max_prompt_length=32)
    demos = arithmetic.demonstrations(problems)
    ptx = text_batch(tokenizer, [d["prompt"] for d in demos], [d["response"] for d in demos], max_length=32)
    return {"model": str(model_dir), "scorer": str(root / "scorer"), "prompts": prompts, "ptx": ptx}


@pytest.fixture(scope="module")
def groups(shared_session, kit):
    s = shared_session
    optim = OptimConfig(lr=1e-4)
    actor = s.group(
        "actor",
        ActorRolloutRefWorker,
        s.pool("actor_pool", 2),
        ActorConfig(model_path=kit["model"], reference=True, optim=optim, mini_batch_size=4, micro_batch_size=2),
    )
    # The critics and the two score models share one process (fused roles): three process
    # starts fewer than a process each, the same calls.
    scoring = s.fused(
        s.pool("critic_pool", 1),
        critic=(CriticWorker, CriticConfig(model_path=kit["model"], optim=optim)),
        cost_critic=(CriticWorker, CriticConfig(model_path=kit["model"], optim=optim)),
        reward_model=(RewardModelWorker, ScoreModelConfig(kit["scorer"])),
        cost_model=(CostModelWorker, ScoreModelConfig(kit["scorer"])),
    )
    yield {
        "actor": actor,
        "critic": scoring["critic"],
        "cost_critic": scoring["cost_critic"],
        "rule": (RuleReward(arithmetic.score), RuleReward(rule_cost, output_key="costs")),
        "model": (scoring["reward_model"], scoring["cost_model"]),
    }
    s.clear()


def make_groups(groups, scoring: str) -> Groups:
    reward, cost = groups[scoring]
    return Groups(
        actor=groups["actor"],
        reference=groups["actor"],
        critic=groups["critic"],
        reward=reward,
        cost=cost,
        cost_critic=groups["cost_critic"],
    )


EXPECTED = {
    "actor/pg_loss",
    "actor/pg_clipfrac",
    "actor/ppo_kl",
    "actor/entropy",
    "actor/grad_norm",
    "critic/score/mean",
    "critic/advantages/mean",
    "response_length/mean",
    "timing_s/gen",
    "timing_s/update_actor",
    "timing_s/step",
    "perf/throughput",
    "actor/rollout_logprob_diff",
}
EXTRA = {
    "ppo": {"critic/vf_loss", "critic/vf_clipfrac", "actor/reward_kl_penalty"},
    "safe_rlhf": {"critic/vf_loss", "cost_critic/vf_loss", "safe/cost/mean", "safe/lambda", "ptx/ptx_loss"},
    "grpo": {"actor/kl_loss"},
    "remax": {"timing_s/gen_greedy"},
}


@pytest.mark.parametrize("scoring", ["rule", "model"])
@pytest.mark.parametrize("name", sorted(algorithms.ALGORITHMS))
def test_two_iterations_give_finite_metrics(groups, kit, name, scoring):
    cls = algorithms.ALGORITHMS[name]
    algo = cls(make_groups(groups, scoring), cls.Config(sampling=SAMPLING))
    for _ in range(2):
        batch, metrics = algo.step(kit["prompts"], ptx=kit["ptx"]) if name == "safe_rlhf" else algo.step(kit["prompts"])
        assert len(batch) == len(kit["prompts"]) * SAMPLING.n
        assert EXPECTED | EXTRA.get(name, set()) <= set(metrics), sorted(set(EXPECTED) - set(metrics))
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, bad
        assert torch.isfinite(batch["advantages"]).all()
        assert metrics["actor/rollout_logprob_diff"] < 1e-3  # generation sampled from the training weights
        assert (batch["advantages"][batch["response_mask"] == 0] == 0).all()
    assert algo.iteration == 2 and len(algo.history) == 2
    assert metrics["timing_s/step"] > 0
    fresh = cls(make_groups(groups, scoring), cls.Config(sampling=SAMPLING))  # the driver's side of a resume
    fresh.load_state_dict(algo.state_dict())
    assert fresh.state_dict() == algo.state_dict() and fresh.iteration == 2
    assert all(getattr(fresh, c) == getattr(algo, c) for c in algo.controllers)  # KL controller, Lagrange multiplier
    # (an untrained model never answers right: with rule rewards GRPO's advantages can all be 0)
    assert metrics["actor/grad_norm"] > 0 or not batch["advantages"].any()


def seen_advantages(log_probs, old_log_probs, advantages, response_mask):
    """A policy loss that also reports the advantages the worker was given."""
    loss, metrics = core.ppo_clip(log_probs, old_log_probs, advantages, response_mask)
    return loss, {**metrics, "actor/adv_abs_sum": float((advantages.abs() * response_mask).sum())}


def test_redefining_an_estimator_between_iterations_changes_the_next_update(groups, kit):
    name = "test_live_grpo"
    core.advantage(name)(core.grpo)
    config = algorithms.GRPOConfig(sampling=SAMPLING, estimator=name, policy_loss=seen_advantages)
    algo = GRPO(make_groups(groups, "model"), config)
    batch, metrics = algo.step(kit["prompts"])
    expected = core.grpo(batch["token_level_rewards"], batch["response_mask"], batch["uid"])[0]
    assert torch.allclose(batch["advantages"], expected)

    @core.advantage(name)  # what a notebook cell does: replace the entry, keep everything running
    def clipped_length_normalised(token_level_rewards, response_mask, uid):
        adv, _ = core.grpo(token_level_rewards, response_mask, uid)
        adv = adv.clamp(-0.5, 0.5) / response_mask.sum(-1, keepdim=True).clamp(min=1)
        return adv, adv

    batch, metrics = algo.step(kit["prompts"])
    grpo_adv = core.grpo(batch["token_level_rewards"], batch["response_mask"], batch["uid"])[0]
    edited = grpo_adv.clamp(-0.5, 0.5) / batch["response_mask"].sum(-1, keepdim=True)
    assert torch.allclose(batch["advantages"], edited)
    assert not torch.allclose(edited, grpo_adv)
    # The workers trained on the edited values: the loss shipped by value reports the sum it
    # saw per optimizer step (2 rows: mini_batch_size 4 over 2 ranks), averaged over all steps.
    rows_per_step = 2
    assert math.isclose(
        metrics["actor/adv_abs_sum"] * len(batch) / rows_per_step,
        float((edited.abs() * batch["response_mask"]).sum()),
        rel_tol=1e-4,
    )
    del core.ADVANTAGES.entries[name]


def broken_score(text: str, truth: str) -> float:
    raise ValueError("the grader is broken")


def test_a_failed_step_leaves_the_algorithm_usable(groups, kit):
    algo = GRPO(
        Groups(actor=groups["actor"], reference=groups["actor"], reward=RuleReward(broken_score)),
        algorithms.GRPOConfig(sampling=SAMPLING),
    )
    with pytest.raises(WorkbenchError, match="broken_score raised on row"):
        algo.step(kit["prompts"])
    assert algo.iteration == 0 and not algo.history
    algo.groups.reward = groups["rule"][0]  # fix the cause in a cell, then carry on
    _, metrics = algo.step(kit["prompts"])
    assert algo.iteration == 1 and metrics["timing_s/step"] < 120
    assert "timing_s/reward" in metrics and math.isfinite(metrics["actor/pg_loss"])


def test_missing_roles_and_bad_settings_are_refused_before_any_remote_work(groups):
    with pytest.raises(ValueError, match=r"PPO needs the role\(s\) \['critic'\].*Groups\(critic=\.\.\.\)"):
        algorithms.PPO(Groups(actor=groups["actor"], reference=groups["actor"], reward=groups["rule"][0]))
    safe = algorithms.SafeRLHF(make_groups(groups, "rule"))
    with pytest.raises(ValueError, match=r"missing \['lagrange'\]"):  # a PPO run's state is not a Safe-RLHF one's
        safe.load_state_dict(GRPO(make_groups(groups, "rule"), algorithms.GRPOConfig(sampling=SAMPLING)).state_dict())
    with pytest.raises(ValueError, match=r"ptx.*\['input_ids', 'attention_mask', 'loss_mask'\].*text_batch"):
        safe.step(None, ptx=(1, 2, 3))
    with pytest.raises(ValueError, match=r"ActorConfig.temperature=1.0 .* sampling.temperature=0.7"):
        GRPO(make_groups(groups, "rule"), algorithms.GRPOConfig(sampling=SamplingConfig(n=2, temperature=0.7)))
    with pytest.raises(ValueError, match="n >= 2"):
        algorithms.GRPOConfig(sampling=SamplingConfig(n=1))
    with pytest.raises(ValueError, match="loss_agg_mode"):
        algorithms.PPOConfig(loss_agg_mode="mean")
    with pytest.raises(
        ValueError,
        match=r"^PPOConfig\.gama=0\.9: no such field in 'PPOConfig'; "
        r"did you mean 'PPOConfig\.gamma'",
    ):
        algorithms.PPOConfig.from_dict({"gama": 0.9})


def test_config_from_yaml(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(
        "sampling: {n: 8, max_new_tokens: 12, temperature: 0.7}\nestimator: drgrpo\nclip_ratio_high: 0.28\n"
    )
    config = algorithms.GRPOConfig.from_yaml(path)
    assert config.sampling.n == 8 and config.sampling.temperature == 0.7
    assert config.estimator == "drgrpo" and config.clip_ratio_high == 0.28 and config.kl_loss_coef == 0.01
    assert dataclasses.replace(config, gamma=0.5).settings()["gamma"] == 0.5


def test_seeded_iterations_draw_fresh_samples_and_runs_repeat(groups, kit):
    """SamplingConfig.seed names a run's streams, not one stream: each iteration samples anew
    (weights are not updated here, so only the stream can differ), and a second run from the
    same start repeats the first exactly."""
    algo = GRPO(make_groups(groups, "rule"), GRPOConfig(sampling=SAMPLING))
    iteration_0 = algo.generate(kit["prompts"]).get()["responses"]
    algo.iteration = 1  # as finish() leaves it after a step
    assert not torch.equal(algo.generate(kit["prompts"]).get()["responses"], iteration_0)
    rerun = GRPO(make_groups(groups, "rule"), GRPOConfig(sampling=SAMPLING))
    assert torch.equal(rerun.generate(kit["prompts"]).get()["responses"], iteration_0)
