"""RLHF algorithms as a few driver lines each, over live worker groups.

    from algorithms import PPO, Groups
    ppo = PPO(Groups(actor=actor, reference=actor, critic=critic, reward=RuleReward(score)))
    batch, metrics = ppo.step(prompts)

`core` holds the numerics (registries of advantage estimators, KL penalties, policy losses);
`base` the shared steps (their table: `workbench.steps`); one file per algorithm holds its recipe.
"""

from algorithms import core
from algorithms.base import AlgoConfig, Algorithm
from algorithms.groups import Groups
from algorithms.grpo import GRPO, GRPOConfig
from algorithms.ppo import PPO, PPOConfig
from algorithms.reinforce_pp import ReinforcePP, ReinforcePPConfig
from algorithms.remax import ReMax, ReMaxConfig
from algorithms.rloo import RLOO, RLOOConfig
from algorithms.safe_rlhf import SafeRLHF, SafeRLHFConfig
from algorithms.show import rollout_table

ALGORITHMS = {
    "ppo": PPO,
    "grpo": GRPO,
    "remax": ReMax,
    "safe_rlhf": SafeRLHF,
    "rloo": RLOO,
    "reinforce_pp": ReinforcePP,
}

__all__ = [
    "ALGORITHMS",
    "AlgoConfig",
    "Algorithm",
    "Groups",
    "core",
    "rollout_table",
    "PPO",
    "PPOConfig",
    "GRPO",
    "GRPOConfig",
    "ReMax",
    "ReMaxConfig",
    "SafeRLHF",
    "SafeRLHFConfig",
    "RLOO",
    "RLOOConfig",
    "ReinforcePP",
    "ReinforcePPConfig",
]
