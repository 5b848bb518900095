"""GRPO (Shao et al. 2024, sec. 4): no critic. Each prompt is sampled n times and every
response's advantage is its reward normalised within its group; the KL to the reference
goes into the loss (k3), not the reward. Dr.GRPO: `estimator="drgrpo"` (no std division)
with `loss_agg_mode="seq-mean-token-sum-norm"` (no length normalisation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from algorithms.base import AlgoConfig, Algorithm
from workbench.engines.rollout import SamplingConfig
from workbench.errors import ConfigError


@dataclass
class GRPOConfig(AlgoConfig):
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(max_new_tokens=16, n=4))
    estimator: str | Callable = "grpo"
    kl_loss_coef: float = 0.01
    kl_loss_type: str = "k3"

    def __post_init__(self):
        super().__post_init__()
        if self.sampling.n < 2:
            raise ConfigError(
                f"{type(self).__name__}.sampling.n",
                self.sampling.n,
                "GRPO compares n >= 2 samples per prompt; use SamplingConfig(n=2) or more",
            )


class GRPO(Algorithm):
    Config = GRPOConfig
    roles = ("actor", "reward")

    def required_roles(self):
        return self.roles + (("reference",) if self.config.kl_loss_coef else ())

    def step(self, prompts):
        gen = self.generate(prompts)
        ref = self.reference(gen) if self.config.kl_loss_coef else None
        batch = self.collect(gen, self.old_log_probs(gen), ref, self.reward(gen))
        batch = self.advantages(self.shape_rewards(batch))
        return batch, self.finish(batch, actor=self.update_actor(batch))
