"""Data that flows between worker groups."""

from typing import TYPE_CHECKING

from workbench.lazy import exports

if TYPE_CHECKING:
    from workbench.data.batch import PAD_KEY, Batch
    from workbench.data.prompts import (
        PromptDataError,
        PromptLoader,
        PromptLoaderConfig,
        load_prompts,
        prompt_ids,
        render_prompt,
        split_held_out,
        tokenize_prompts,
        write_arithmetic,
        write_jsonl,
    )
    from workbench.data.tasks import Task, get_task, register_task

# Imported on first use: a task's reward function (workbench.data.arithmetic.score) unpickled
# in a scoring process loads its own module, not Batch's torch and tensordict (seconds).
_PROMPTS = (
    "PromptDataError",
    "PromptLoader",
    "PromptLoaderConfig",
    "load_prompts",
    "prompt_ids",
    "render_prompt",
    "split_held_out",
    "tokenize_prompts",
    "write_arithmetic",
    "write_jsonl",
)
_LAZY = {
    "PAD_KEY": "workbench.data.batch",
    "Batch": "workbench.data.batch",
    **dict.fromkeys(_PROMPTS, "workbench.data.prompts"),
    "Task": "workbench.data.tasks",
    "get_task": "workbench.data.tasks",
    "register_task": "workbench.data.tasks",
}
__all__ = list(_LAZY)
__getattr__ = exports(__name__, _LAZY)
