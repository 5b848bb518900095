"""The stages before RL: supervised fine-tuning of the actor, and reward/cost-model training.

Both take a `StageConfig`. ("Stage" means these pre-RL training stages only; an RL
iteration is made of steps, `workbench.steps`.)
"""

from workbench.stages.reward_model import pairwise_accuracy, train_reward_model
from workbench.stages.sft import (
    StageConfig,
    encode_conversations,
    encode_demonstrations,
    encode_examples,
    text_batch,
    train_sft,
)

__all__ = [
    "StageConfig",
    "encode_conversations",
    "encode_demonstrations",
    "encode_examples",
    "pairwise_accuracy",
    "text_batch",
    "train_reward_model",
    "train_sft",
]
