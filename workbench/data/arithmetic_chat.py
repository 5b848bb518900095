"""The arithmetic task for chat models: the same problems, put as a conversation.

    messages(problem)  ->  [{"role": "user", "content": "What is 37 + 48? Answer with the number only."}]
    score("37 + 48 = 85", "85")  ->  1.0

The prompt is a chat (rendered with the model's template by workbench.data.prompts), so an
instruct model answers in its own turn instead of continuing a `Q: ... A:` text. No system line
by default: the model's template supplies its own (SmolLM2's), and a line of ours such as "You
are a careful calculator." made SmolLM2-135M-Instruct explain instead of answer.

The rule reward reads the assistant's text (the response decoded without special tokens, so an
end-of-turn token such as `<|im_end|>` is not part of it) and grades its final number, as
GSM8K-style checkers do: "85", "The answer is 85.", "37 + 48 = 85" and "**85**" are right;
"85.0", "085", "84", "85 + 1 = 86" and "" are not. The instruction's "number only" is not
enforced: SmolLM2 answers `37 + 48 = 85` far more often than `85`, and a strict form left it
with no right sample at all to learn from (0 of 128 sampled at temperature 1, issue 23).
"""

from __future__ import annotations

import re

from workbench.data.arithmetic import Problem

SYSTEM: str | None = None
"""The system line of every chat prompt (None: the template's own default)."""
QUESTION = "What is {expression}? Answer with the number only."
"""The user's turn; `{expression}` is the problem's with spaced operators, e.g. `37 + 48`."""

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def spaced(expression: str) -> str:
    """`37+48*2` -> `37 + 48 * 2` (a minus after an operator or at the start is a sign, kept)."""
    return re.sub(r"(?<=\d)([+\-*])", r" \1 ", expression)


def messages(problem: Problem, system: str | None = SYSTEM) -> list[dict[str, str]]:
    """The problem as a chat: a system line (when given) and the user's question."""
    question = {"role": "user", "content": QUESTION.format(expression=spaced(problem.expression))}
    return [{"role": "system", "content": system}, question] if system else [question]


def extract_answer(response: str) -> str | None:
    """The response's final number as written ("85", "-12", "85.0"), or None without one."""
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def score(response: str, ground_truth: str) -> float:
    """1.0 when the assistant's final number is the answer exactly (see the module docstring)."""
    return 1.0 if extract_answer(response) == ground_truth.strip() else 0.0
