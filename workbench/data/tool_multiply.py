"""A task where tools pay: multi-digit multiplication with a calculator, put as a chat.

    messages(problem)                ->  [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": "What is 123 * 45?"}]
    demonstration(problem)           ->  ... + [{"role": "assistant", "content": tool_call("123 * 45")},
                                                {"role": "tool", "content": "5535"},
                                                {"role": "assistant", "content": "5535"}]
    score("5535", "5535") -> 1.0;  score(tool_call("123 * 45"), "5535") -> 0.0

A 3-digit by 2-digit product is beyond what a small model computes in its head, and one
calculator call away: the system line tells the model about the calculator and the
`<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>` format
(workbench.agents.env reads it), the user asks the question. An episode ends with a turn that
calls no tool; that turn's final number is the answer (arithmetic_chat's rule). A turn that is
still a tool call scores 0, whatever numbers its expression holds.

`messages(problem, tools=False)` asks the same question with no calculator on offer: held-out
exact match "without tools" is measured on it, in a single turn.

The problems are `arithmetic.Problem`s (expression `123*45`, ground truth `5535`); `split`
gives training and held-out problems that share no expression.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from workbench import checks
from workbench.data import arithmetic_chat
from workbench.data.arithmetic import Problem

SYSTEM = (
    "You have a calculator. To use it, write "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call> '
    "and wait for its answer. Then give the answer as a number."
)
"""The system line when tools are allowed."""
SYSTEM_NO_TOOLS = "Answer with the number only."
"""The system line when they are not."""
QUESTION = "What is {expression}?"
TOOL_CALL_OPEN = "<tool_call>"


@dataclass(frozen=True)
class MultiplyConfig:
    """Which products are asked."""

    digits: tuple[int, ...] = (3, 2)
    """Digits of each factor: (3, 2) asks 3-digit x 2-digit products, e.g. 123 * 45."""

    def __post_init__(self):
        if len(self.digits) < 2 or not all(checks.is_whole(d, low=1) for d in self.digits):
            raise ValueError(f"MultiplyConfig.digits={self.digits!r}: give two or more digit counts >= 1, e.g. (3, 2)")
        object.__setattr__(self, "digits", tuple(self.digits))


def generate(cfg: MultiplyConfig, n: int, seed: int = 0) -> list[Problem]:
    """n products with the factors' digit counts of `cfg`; the same (cfg, n, seed), the same list."""
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        factors = [rng.randint(10 ** (d - 1), 10**d - 1) for d in cfg.digits]
        product = 1
        for f in factors:
            product *= f
        expression = "*".join(map(str, factors))
        question = QUESTION.format(expression=arithmetic_chat.spaced(expression))
        problems.append(Problem(question, str(product), expression))
    return problems


RESERVED = 256
"""Held-out problems set aside whatever a split asks for: a split's held-out problems are the
first of them, and no split's training problems are any of them (so a model trained on one
split is never evaluated on its own training problems under another)."""


def split(cfg: MultiplyConfig, n_train: int, n_heldout: int, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """Training and held-out problems, distinct within each and sharing no expression: the
    held-out ones come from their own seed (the first `n_heldout` of `RESERVED` set aside) and
    training draws skip every reserved one."""
    reserve = max(n_heldout, RESERVED)
    heldout = _distinct(generate(cfg, 4 * reserve + 16, seed=2 * seed + 1), reserve, set())
    seen = {p.expression for p in heldout}
    train = _distinct(generate(cfg, 4 * n_train + 16, seed=2 * seed), n_train, seen)
    if len(train) < n_train or len(heldout) < n_heldout:
        raise ValueError(
            f"tool_multiply.split: only {len(train)} training and {len(heldout)} held-out distinct problems of "
            f"digits {cfg.digits}; ask for fewer, or longer factors"
        )
    return train, heldout[:n_heldout]


def _distinct(problems: list[Problem], n: int, taken: set[str]) -> list[Problem]:
    out: list[Problem] = []
    for p in problems:
        if p.expression not in taken and len(out) < n:
            taken.add(p.expression)
            out.append(p)
    return out


# ---- the chat ----------------------------------------------------------------------------------
def messages(problem: Problem, tools: bool = True) -> list[dict[str, str]]:
    """The problem as a chat: the system line (the calculator, or none on offer) and the question."""
    question = QUESTION.format(expression=arithmetic_chat.spaced(problem.expression))
    return [{"role": "system", "content": SYSTEM if tools else SYSTEM_NO_TOOLS}, {"role": "user", "content": question}]


def tool_call(expression: str) -> str:
    """The policy's text that calls the calculator on `expression`."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"{TOOL_CALL_OPEN}{json.dumps(call)}</tool_call>"


def demonstration(problem: Problem, tools: bool = True) -> list[dict[str, str]]:
    """A whole episode as messages: with tools, the call, the calculator's reply in the tool role
    and the answer; without, the answer alone (after the same tools-allowed prompt when `tools`
    is False: a policy that could have called and did not)."""
    asked = messages(problem, tools=True)
    if not tools:
        return [*asked, {"role": "assistant", "content": problem.ground_truth}]
    return [
        *asked,
        {"role": "assistant", "content": tool_call(arithmetic_chat.spaced(problem.expression))},
        {"role": "tool", "content": problem.ground_truth},
        {"role": "assistant", "content": problem.ground_truth},
    ]


def demonstrations(problems: list[Problem], tool_share: float = 1.0, seed: int = 0) -> list[dict]:
    """SFT rows {"messages": [...]}: a `tool_share` of them use the calculator, the rest answer
    directly (correctly: a small model cannot learn the products, so it learns to guess; RL then
    finds that calling pays)."""
    checks.real("tool_multiply.demonstrations", "tool_share", tool_share, 0, 1, fix="use a share in [0, 1]")
    rng = random.Random(seed)
    return [{"messages": demonstration(p, tools=rng.random() < tool_share)} for p in problems]


def score(response: str, ground_truth: str) -> float:
    """1.0 when the final turn's last number is the product; 0 for a turn that is (still) a tool call."""
    if TOOL_CALL_OPEN in response:
        return 0.0
    return arithmetic_chat.score(response, ground_truth)


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    """Texts of the task's chats (system lines, questions, calls, replies, role names): tokenizer
    training text for the tiny chat kit."""
    texts = []
    for p in generate(MultiplyConfig(), n, seed=seed):
        for m in demonstration(p):
            texts.append(f"{m['role']}\n{m['content']}")
        texts.append(SYSTEM_NO_TOOLS)
    return texts
