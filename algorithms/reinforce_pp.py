"""REINFORCE++ (Hu 2025): no critic; token-level KL in the reward, discounted returns, and one
global whitening of the advantages over the batch. With n > 1 samples per prompt,
`estimator="reinforce_pp_baseline"` first subtracts each prompt's mean reward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from algorithms.base import AlgoConfig, Algorithm


@dataclass
class ReinforcePPConfig(AlgoConfig):
    estimator: str | Callable = "reinforce_pp"
    kl_coef: float = 0.05


class ReinforcePP(Algorithm):
    Config = ReinforcePPConfig
    roles = ("actor", "reference", "reward")

    def step(self, prompts):
        gen = self.generate(prompts)
        batch = self.collect(gen, self.old_log_probs(gen), self.reference(gen), self.reward(gen))
        batch = self.advantages(self.shape_rewards(batch))
        return batch, self.finish(batch, actor=self.update_actor(batch))
