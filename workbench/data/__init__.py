"""Data that flows between worker groups."""

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
