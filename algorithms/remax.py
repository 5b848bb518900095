"""ReMax (Li et al. 2024): REINFORCE whose baseline is the reward of the greedy response to the
same prompt — one extra greedy generation per iteration, and no critic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from algorithms.base import AlgoConfig, Algorithm


@dataclass
class ReMaxConfig(AlgoConfig):
    estimator: str | Callable = "remax"
    kl_coef: float = 0.05


class ReMax(Algorithm):
    Config = ReMaxConfig
    roles = ("actor", "reference", "reward")

    def step(self, prompts):
        gen = self.generate(prompts)
        greedy_sampling = replace(self.config.sampling, greedy=True, n=1)
        greedy = self.generate(prompts, greedy_sampling, step="gen_greedy", new_iteration=False)
        baseline = self.reward(greedy, step="reward_greedy")
        batch = self.collect(gen, self.old_log_probs(gen), self.reference(gen), self.reward(gen))
        batch["reward_baselines"] = baseline.get()["scores"].repeat_interleave(self.config.sampling.n)
        batch = self.advantages(self.shape_rewards(batch))
        return batch, self.finish(batch, actor=self.update_actor(batch))
