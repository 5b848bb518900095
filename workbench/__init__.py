"""HybridFlow Workbench: a notebook-first RLHF workbench on a single controller over Ray."""

import os

# Per-load progress bars from transformers/huggingface_hub swamp notebook cells and worker logs
# (tiny models load in milliseconds). Set before they are imported; Ray workers inherit it.
# Export HF_HUB_DISABLE_PROGRESS_BARS=0 to have them back.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from workbench.controller import (
    ALL_TO_ALL,
    DP_PROTO,
    DP_REDUCED,
    ONE_TO_ALL,
    ONE_TO_ALL_KEEP_RANK0,
    THREE_D_ALL_MICRO_DP,
    THREE_D_PP_ONLY,
    THREE_D_PROTO,
    DataFuture,
    Mesh,
    Protocol,
    ResourcePool,
    Worker,
    WorkerGroup,
    register,
)
from workbench.data import Batch
from workbench.errors import DispatchError, PlacementError, WorkerCallError, WorkerDiedError
from workbench.session import Session

# Heavier pieces a notebook needs, imported on first use (worker processes import this package
# too, and most never touch the model stack): `from workbench import ActorConfig, RuleReward`.
_LAZY = {
    "ActorConfig": "workbench.workers.actor",
    "ActorRolloutRefWorker": "workbench.workers.actor",
    "CriticConfig": "workbench.workers.critic",
    "CriticWorker": "workbench.workers.critic",
    "ScoreModelConfig": "workbench.workers.reward",
    "RewardModelWorker": "workbench.workers.reward",
    "CostModelWorker": "workbench.workers.reward",
    "RuleReward": "workbench.workers.rule_reward",
    "EpisodeReward": "workbench.workers.episode_reward",
    "EpisodeConfig": "workbench.engines.multi_turn",
    "SamplingConfig": "workbench.engines.rollout",
    "OptimConfig": "workbench.engines.contract",
    "LoRAConfig": "workbench.models.lora",
    "arithmetic": "workbench.data",
    "tokenize_prompts": "workbench.data.prompts",
    "PromptLoader": "workbench.data.prompts",
    "load_model": ("workbench.models", "load"),
    "arithmetic_policy": "workbench.stages.arithmetic_policy",
    "text_timeline": "workbench.tracing",
    "tags": "workbench.tracing",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}")
    import importlib

    module, attribute = _LAZY[name] if isinstance(_LAZY[name], tuple) else (_LAZY[name], name)
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


__all__ = [
    *_LAZY,
    "ALL_TO_ALL",
    "DP_PROTO",
    "DP_REDUCED",
    "ONE_TO_ALL",
    "ONE_TO_ALL_KEEP_RANK0",
    "THREE_D_ALL_MICRO_DP",
    "THREE_D_PP_ONLY",
    "THREE_D_PROTO",
    "Batch",
    "DataFuture",
    "DispatchError",
    "Mesh",
    "PlacementError",
    "Protocol",
    "ResourcePool",
    "Session",
    "Worker",
    "WorkerCallError",
    "WorkerDiedError",
    "WorkerGroup",
    "register",
]
