"""HybridFlow Workbench: a notebook-first RLHF workbench on a single controller over Ray."""

import os

from workbench.lazy import exports

# Per-load progress bars from transformers/huggingface_hub swamp notebook cells and worker logs
# (tiny models load in milliseconds). Set before they are imported; Ray workers inherit it.
# Export HF_HUB_DISABLE_PROGRESS_BARS=0 to have them back.
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

# Every name is imported on first use: `import workbench` stays cheap, and a pure module
# (workbench.mesh, workbench.planner) loads without Ray or torch. `from workbench import Session`.
_CONTROLLER = (
    "ALL_TO_ALL",
    "DP_PROTO",
    "DP_REDUCED",
    "ONE_TO_ALL",
    "ONE_TO_ALL_KEEP_RANK0",
    "THREE_D_ALL_MICRO_DP",
    "THREE_D_PP_ONLY",
    "THREE_D_PROTO",
    "DataFuture",
    "Protocol",
    "ResourcePool",
    "Worker",
    "WorkerGroup",
    "register",
)
_LAZY = {
    **dict.fromkeys(_CONTROLLER, "workbench.controller"),
    "Mesh": "workbench.mesh",
    "Batch": "workbench.data.batch",
    "DispatchError": "workbench.errors",
    "PlacementError": "workbench.errors",
    "WorkerCallError": "workbench.errors",
    "WorkerDiedError": "workbench.errors",
    "Session": "workbench.session",
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
    "arithmetic": ("workbench.data.arithmetic", None),
    "tokenize_prompts": "workbench.data.prompts",
    "PromptLoader": "workbench.data.prompts",
    "load_model": ("workbench.models", "load"),
    "arithmetic_policy": "workbench.stages.arithmetic_policy",
    "text_timeline": "workbench.tracing",
    "tags": "workbench.tracing",
}


__getattr__ = exports(__name__, _LAZY)


# What a notebook may need beyond the pinned environment: a name -> (what it is, why it is
# missing or None). Each probe imports its module only when asked.
def _smollm2() -> str | None:
    from workbench.models.gguf_import import GGUFImportError, resolve_gguf

    try:
        resolve_gguf("smollm2")
    except GGUFImportError as missing:
        return str(missing)
    return None


def _bubblewrap() -> str | None:
    from workbench.agents.jail import unavailable

    return unavailable()


_NEEDS = {
    "smollm2": ("SmolLM2-135M-Instruct's GGUF file", _smollm2),
    "bubblewrap": ("bubblewrap (the tool sandboxes' jail)", _bubblewrap),
}


def needs(*names: str) -> None:
    """A notebook's first cell: say which Python this kernel runs, check that what the notebook
    needs beyond the pinned environment is here (`needs("smollm2", "bubblewrap")`), and raise
    naming each missing piece and how to install it."""
    import sys

    unknown = [name for name in names if name not in _NEEDS]
    if unknown:
        raise ValueError(f"needs: unknown {unknown}; known: {sorted(_NEEDS)}")
    missing = {name: why for name in names if (why := _NEEDS[name][1]())}
    if missing:
        raise RuntimeError(
            "this notebook needs what is missing here:\n"
            + "\n".join(f"- {_NEEDS[name][0]}: {why}" for name, why in missing.items())
        )
    found = "found " + ", ".join(_NEEDS[name][0] for name in names) if names else "nothing else needed"
    print(f"kernel: Python {sys.version.split()[0]} in {sys.prefix} ({os.cpu_count()} CPU cores); {found}")


__all__ = [*_LAZY, "needs"]
