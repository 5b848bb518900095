"""PPO for RLHF (Ouyang et al. 2022; HybridFlow Fig. 6): actor, critic, reference, reward.

Per iteration: sample responses; score them with the reward, the reference policy and the
critic (these overlap when their pools are disjoint); fold the KL to the reference into the
reward; estimate advantages with GAE; update the critic and the actor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from algorithms.base import AlgoConfig, Algorithm


@dataclass
class PPOConfig(AlgoConfig):
    estimator: str | Callable = "gae"
    kl_coef: float = 0.05


class PPO(Algorithm):
    Config = PPOConfig
    roles = ("actor", "reference", "critic", "reward")
    log_keys = ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "actor/reward_kl_penalty", "timing_s/step")

    def step(self, prompts):
        gen = self.generate(prompts)
        batch = self.collect(gen, self.old_log_probs(gen), self.reference(gen), self.values(gen), self.reward(gen))
        batch = self.advantages(self.shape_rewards(batch))
        return batch, self.finish(batch, critic=self.update_critic(batch), actor=self.update_actor(batch))
