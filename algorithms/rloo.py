"""RLOO (Ahmadian et al. 2024): k samples per prompt; each one's baseline is the mean reward of
the other k-1. No critic; the KL to the reference is folded into the reward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from algorithms.base import AlgoConfig, Algorithm
from workbench.engines.rollout import SamplingConfig
from workbench.errors import ConfigError


@dataclass
class RLOOConfig(AlgoConfig):
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(max_new_tokens=16, n=4))
    estimator: str | Callable = "rloo"
    kl_coef: float = 0.05

    def __post_init__(self):
        super().__post_init__()
        if self.sampling.n < 2:
            raise ConfigError(
                f"{type(self).__name__}.sampling.n",
                self.sampling.n,
                "leave-one-out needs n >= 2 samples per prompt; use SamplingConfig(n=2) or more",
            )


class RLOO(Algorithm):
    Config = RLOOConfig
    roles = ("actor", "reference", "reward")

    def step(self, prompts):
        gen = self.generate(prompts)
        batch = self.collect(gen, self.old_log_probs(gen), self.reference(gen), self.reward(gen))
        batch = self.advantages(self.shape_rewards(batch))
        return batch, self.finish(batch, actor=self.update_actor(batch))
