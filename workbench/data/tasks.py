"""Tasks by name: the rule reward and cost functions a config can refer to as a string.

A rule-reward worker is configured with `task: arithmetic` and looks the functions up
here; a notebook can register its own task (e.g. a GSM8K-style checker) the same way.

    arithmetic        `Q: 37+48=? A:` text prompts, the leading integer of the response scored
    arithmetic_chat   the same problems as a chat (system + user), the assistant's text scored
                      strictly: the number alone (workbench.data.arithmetic_chat)
    tool_multiply     3-digit x 2-digit products as a chat that offers a calculator; the
                      episode's final turn scored by its last number, 0 while it is still a
                      tool call (workbench.data.tool_multiply: its own problems and split; run
                      as episodes in a ToolEnvironment)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from workbench.data import arithmetic, arithmetic_chat, tool_multiply


def text_prompt(problem: arithmetic.Problem) -> str:
    """A problem's own text (its ArithmeticConfig.template filled in)."""
    return problem.prompt


@dataclass(frozen=True)
class Task:
    """The plain functions that judge responses to a task's prompts."""

    name: str
    score: Callable[[str, str], float]
    """`score(response_text, ground_truth) -> float`, the rule reward."""
    cost: Callable[[str], float] | None = None
    """`cost(response_text) -> float` (> 0 is unsafe), for Safe-RLHF; None if not defined."""
    prompt: Callable[[arithmetic.Problem], str | list[dict[str, str]]] = text_prompt
    """How a generated arithmetic problem is put to the model: text, or chat messages."""


TASKS: dict[str, Task] = {}


def register_task(task: Task) -> Task:
    """Add or replace a task (re-running a notebook cell replaces it)."""
    TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise KeyError(f"unknown task {name!r}; registered tasks: {sorted(TASKS)} (add one with register_task)")
    return TASKS[name]


register_task(Task("arithmetic", arithmetic.score, arithmetic.cost))
register_task(Task("arithmetic_chat", arithmetic_chat.score, prompt=arithmetic_chat.messages))
register_task(Task("tool_multiply", tool_multiply.score, prompt=tool_multiply.messages))
