"""Safe-RLHF (Dai et al. 2023): PPO under a cost constraint E[cost] <= budget, solved as a
Lagrangian. A cost model and a cost critic join PPO's roles; each iteration moves lambda
towards the constraint, and the actor follows (A_reward - lambda A_cost) / (1 + lambda).
With pre-training rows passed to `step`, the actor also takes a PPO-ptx step on them.

Unlike the paper's code, the default GAE whitens each advantage stream, so lambda weighs
standardised advantages (its value is not on the paper's scale); pass an estimator that does
not whiten to match it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from algorithms import core
from algorithms.base import AlgoConfig, Algorithm
from algorithms.losses import CriticLoss, PretrainLoss
from workbench import checks, steps


@dataclass
class SafeRLHFConfig(AlgoConfig):
    kl_coef: float = 0.05
    cost_budget: float = 0.0
    """The constraint: mean episode cost at most this (Safe-RLHF's threshold d)."""
    lambda_init: float = 1.0
    lambda_lr: float = 0.1
    lambda_max: float = 100.0
    ptx_coef: float = 1.0
    """Weight of the pre-training loss when ptx rows are given to step()."""

    def validate(self) -> None:
        super().validate()
        owner = type(self).__name__
        checks.real(owner, "cost_budget", self.cost_budget, fix="use a finite mean-cost limit")
        checks.real(owner, "lambda_init", self.lambda_init, 0, fix="use a starting multiplier >= 0")
        checks.real(owner, "lambda_lr", self.lambda_lr, 0, low_open=True, fix="use a multiplier step size > 0")
        checks.real(owner, "lambda_max", self.lambda_max, self.lambda_init, fix="use a cap >= lambda_init")
        checks.real(owner, "ptx_coef", self.ptx_coef, 0, fix="use a pre-training loss weight >= 0")


class SafeRLHF(Algorithm):
    Config = SafeRLHFConfig
    roles = ("actor", "reference", "critic", "reward", "cost", "cost_critic")
    log_keys = ("critic/score/mean", "safe/cost/mean", "safe/lambda", "actor/pg_loss", "timing_s/step")
    controllers = ("kl_ctl", "lagrange")

    def __init__(self, groups, config=None):
        super().__init__(groups, config)
        cfg = self.config
        self.lagrange = core.LagrangeMultiplier(cfg.lambda_init, cfg.lambda_lr, cfg.cost_budget, cfg.lambda_max)

    def step(self, prompts, ptx=None):
        if ptx is not None:
            PretrainLoss.check(ptx)
        gen = self.generate(prompts)
        batch = self.collect(
            gen,
            self.old_log_probs(gen),
            self.reference(gen),
            self.values(gen),
            self.reward(gen),
            self.cost_values(gen),
            self.cost(gen),
        )
        batch = self.advantages(self.shape_rewards(batch))
        updates = dict(
            critic=self.update_critic(batch),
            cost_critic=self.update_critic(
                batch, self.groups.cost_critic, self.cost_critic_loss(), step="update_cost_critic"
            ),
            actor=self.update_actor(batch),
        )
        if ptx is not None:
            updates["ptx"] = self.update_actor(ptx, PretrainLoss(self.config.ptx_coef), step="update_ptx")
        return batch, self.finish(batch, **updates)

    def cost(self, gen):
        return self.clock.launch(steps.COST.name, self.groups.cost.compute_cost(gen), gen)

    def cost_values(self, gen):
        values = self.groups.cost_critic.compute_values(gen, "cost_values")
        return self.clock.launch(steps.COST_VALUES.name, values, gen)

    def cost_critic_loss(self):
        return CriticLoss(self.config.cliprange_value, self.config.loss_agg_mode, "cost_values", "cost_returns")

    def shape_rewards(self, batch):
        """The KL penalty split between the two signals (as Safe-RLHF does): r - beta/2 KL and
        c + beta/2 KL, so the actor's (A_r - lambda A_c) / (1 + lambda) keeps beta/2 on the KL
        whatever lambda grows to."""
        batch = super().shape_rewards(batch, share=0.5)
        beta = batch.info.get("actor/reward_kl_penalty_coeff", 0.0)  # the one the rewards used
        kl = batch["token_level_kl"] if "token_level_kl" in batch else 0.0
        batch["token_level_cost_rewards"] = batch["token_level_costs"] + 0.5 * beta * kl
        return batch

    def advantages(self, batch, estimator=None):
        """Reward and cost advantages with the same estimator; lambda steps on this batch's
        mean cost first, then weighs them (Safe-RLHF's actor objective)."""
        name = estimator or self.config.estimator
        fn, settings, what = core.ADVANTAGES.get(name), self.config.settings(), f"advantage estimator {name!r}"
        with self.clock.measure(steps.ADV.name):
            reward_advantages, batch["returns"] = core.call(fn, batch, settings, what=what)
            costs = {"token_level_rewards": batch["token_level_cost_rewards"], "values": batch["cost_values"]}
            batch["cost_advantages"], batch["cost_returns"] = core.call(fn, costs, batch, settings, what=what)
            mean_cost = float(batch["costs"].mean())
            self.lagrange.update(mean_cost)
            batch["advantages"] = core.safe_advantages(reward_advantages, batch["cost_advantages"], self.lagrange.value)
        batch.info |= {
            "safe/cost/mean": mean_cost,
            "safe/lambda": self.lagrange.value,
            "safe/cost_budget": self.config.cost_budget,
        }
        return batch
