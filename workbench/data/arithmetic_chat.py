"""The arithmetic task for chat models: the same problems, put as a conversation.

    messages(problem)  ->  [{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": "What is 37 + 48? Answer with the number only."}]
    score(" 85.", "85")  ->  1.0

The prompt is a chat (rendered with the model's template by workbench.data.prompts), so an
instruct model answers in its own turn instead of continuing a `Q: ... A:` text. The rule
reward reads the assistant's text (the response decoded without special tokens, so an
end-of-turn token such as `<|im_end|>` is not part of it) and is strict about form: the
number alone, allowing surrounding whitespace and one trailing full stop ("85", " 85.\\n").
Anything else scores 0, however right the number in it: "The answer is 85", "37 + 48 = 85",
"85 apples", "85.0", "+85", "085". The instruction asks for the number only, and following it is
part of the task (as in the baseline check of issue 23, where answers like
`27 + 82 = 198` were counted wrong).
"""

from __future__ import annotations

import re

from workbench.data.arithmetic import Problem

SYSTEM = "You are a careful calculator."
"""The system line of every chat prompt."""
QUESTION = "What is {expression}? Answer with the number only."
"""The user's turn; `{expression}` is the problem's with spaced operators, e.g. `37 + 48`."""

_ANSWER = re.compile(r"\s*(-?\d+)\.?\s*")


def spaced(expression: str) -> str:
    """`37+48*2` -> `37 + 48 * 2` (a minus after an operator or at the start is a sign, kept)."""
    return re.sub(r"(?<=\d)([+\-*])", r" \1 ", expression)


def messages(problem: Problem, system: str = SYSTEM) -> list[dict[str, str]]:
    """The problem as a chat: a system line and the user's question."""
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": QUESTION.format(expression=spaced(problem.expression))},
    ]


def extract_answer(response: str) -> str | None:
    """The number when the response is that number alone (whitespace and one trailing full
    stop allowed), else None."""
    match = _ANSWER.fullmatch(response)
    return match.group(1) if match else None


def score(response: str, ground_truth: str) -> float:
    """1.0 when the assistant's text is exactly the answer (see the module docstring), else 0.0."""
    answer = extract_answer(response)
    return 1.0 if answer is not None and answer == ground_truth.strip() else 0.0
