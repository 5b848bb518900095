"""The arithmetic task: `Q: 37+48=? A:` -> ` 85`.

A small task with an exact, cheap rule reward, so every part of RLHF (the SFT and reward-model
stages, PPO/GRPO, Safe-RLHF) can be run and checked on CPU in minutes:

- `generate(cfg, n, seed)`  problems, deterministic for a seed;
- `split(cfg, n_train, n_heldout)`  training and held-out problems sharing no expression;
- `score(response, truth)`  exact-match reward (the rule reward);
- `demonstrations(...)`     prompt + correct response, for SFT;
- `preference_pairs(...)`   chosen (correct) vs rejected (wrong), for Bradley-Terry RM training;
- `cost(response, ...)`     a Safe-RLHF cost signal: 1.0 when an answer is "unsafe".

Text format: the prompt ends with "A:" and a response starts with a space, so that
prompt + response reads `Q: 37+48=? A: 85`. Expressions use the usual precedence
(`*` before `+`/`-`); answers may be negative.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field, replace

from workbench import checks

OPERATIONS = ("+", "-", "*")


@dataclass(frozen=True)
class ArithmeticConfig:
    """Difficulty knobs of the arithmetic task."""

    digits: int = 2
    """Most digits per operand (operands are drawn uniformly from 0 .. 10**digits - 1)."""
    min_digits: int = 1
    """Fewest digits per operand; `min_digits == digits` gives fixed-width operands."""
    operations: tuple[str, ...] = ("+",)
    """Operators to draw from, a subset of `+ - *`."""
    num_operands: int = 2
    """Operands per expression (2 gives `a+b`; 3 gives `a+b*c`, evaluated with precedence)."""
    template: str = "Q: {expression}=? A:"
    """Prompt text; `{expression}` is replaced by e.g. `37+48`."""

    def __post_init__(self):
        bad = [op for op in self.operations if op not in OPERATIONS]
        if bad or not self.operations:
            raise ValueError(f"ArithmeticConfig.operations={self.operations!r}: use a non-empty subset of {OPERATIONS}")
        checks.whole("ArithmeticConfig", "min_digits", self.min_digits, fix="use a whole number of digits >= 1")
        checks.whole(
            "ArithmeticConfig",
            "digits",
            self.digits,
            low=self.min_digits,
            fix=f"use a whole number of digits >= min_digits ({self.min_digits})",
        )
        checks.whole(
            "ArithmeticConfig", "num_operands", self.num_operands, low=2, fix="use a whole number of operands >= 2"
        )
        if "{expression}" not in self.template:
            raise ValueError(f"ArithmeticConfig.template must contain '{{expression}}', got {self.template!r}")


@dataclass(frozen=True)
class Problem:
    """One arithmetic question."""

    prompt: str
    """Text given to the model, e.g. `Q: 37+48=? A:`."""
    ground_truth: str
    """The answer as text, e.g. `85` or `-12`."""
    expression: str = field(default="")
    """The bare expression, e.g. `37+48`."""


def evaluate(operands: list[int], operators: list[str]) -> int:
    """Value of `operands[0] op0 operands[1] op1 ...` with `*` binding tighter than `+`/`-`."""
    terms, signs, product = [], [1], operands[0]
    for op, value in zip(operators, operands[1:]):
        if op == "*":
            product *= value
        else:
            terms.append(product)
            signs.append(1 if op == "+" else -1)
            product = value
    terms.append(product)
    return sum(s * t for s, t in zip(signs, terms))


def _operand(rng: random.Random, cfg: ArithmeticConfig) -> int:
    digits = rng.randint(cfg.min_digits, cfg.digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def generate(cfg: ArithmeticConfig, n: int, seed: int = 0) -> list[Problem]:
    """n problems; the same (cfg, n, seed) always gives the same list (a private RNG is used)."""
    rng = random.Random(seed)
    problems = []
    for _ in range(n):
        operands = [_operand(rng, cfg) for _ in range(cfg.num_operands)]
        operators = [rng.choice(cfg.operations) for _ in range(cfg.num_operands - 1)]
        expression = str(operands[0]) + "".join(f"{op}{v}" for op, v in zip(operators, operands[1:]))
        answer = str(evaluate(operands, operators))
        problems.append(Problem(cfg.template.format(expression=expression), answer, expression))
    return problems


def split(cfg: ArithmeticConfig, n_train: int, n_heldout: int, seed: int = 0) -> tuple[list[Problem], list[Problem]]:
    """Training and held-out problems, each expression once and none in both, so a held-out
    accuracy measures what training taught beyond the prompts it saw. The first `n_heldout`
    distinct expressions of the seed's draw are held out, the next `n_train` train. A one-digit
    task has 100 expressions in all."""
    first: dict[str, Problem] = {}
    for problem in generate(cfg, 50 * (n_train + n_heldout), seed=seed):
        first.setdefault(problem.expression, problem)
    distinct = list(first.values())
    if len(distinct) < n_train + n_heldout:
        raise ValueError(
            f"arithmetic.split: {n_train} training and {n_heldout} held-out problems need {n_train + n_heldout} "
            f"distinct expressions; digits={cfg.digits} gave {len(distinct)}. Ask for fewer, or use more digits"
        )
    return distinct[n_heldout : n_heldout + n_train], distinct[:n_heldout]


def harder(cfg: ArithmeticConfig) -> ArithmeticConfig:
    """A harder split of `cfg`'s task: every operand one digit longer than `cfg`'s longest
    (same operations and count). No expression of it can be one of `cfg`'s, so a held-out set
    drawn from it is disjoint from training by construction, whatever the seeds."""
    return replace(cfg, min_digits=cfg.digits + 1, digits=cfg.digits + 1)


# ---- rewards -------------------------------------------------------------------------------
# The answer is the first integer of the response; anything after it (eos text, a newline and
# a hallucinated next question, a full stop) is ignored, but "85.5" or "855" is not "85".
_ANSWER = re.compile(r"\s*(-?\d+)(?![\d]|[.,]\d)")


def extract_answer(response: str) -> str | None:
    """The integer a response starts with (after whitespace), or None if it starts otherwise."""
    match = _ANSWER.match(response)
    return match.group(1) if match else None


def score(response: str, ground_truth: str, format_score: float = 0.0) -> float:
    """Exact-match reward: 1.0 if the response's leading integer equals the ground truth.

    `format_score` is given for a well-formed but wrong answer (verl's GSM8K reward uses the
    same idea); 0.0 for a response that does not start with an integer.
    """
    answer = extract_answer(response)
    if answer is None:
        return 0.0
    return 1.0 if answer == ground_truth.strip() else float(format_score)


# ---- data for the pre-RL stages --------------------------------------------------------------
def response_text(answer: str) -> str:
    """How an answer is written after the prompt (a leading space, no eos: the trainer adds it)."""
    return f" {answer}"


def demonstrations(problems: list[Problem]) -> list[dict[str, str]]:
    """SFT rows `{prompt, response}` with the correct answer as the response."""
    return [{"prompt": p.prompt, "response": response_text(p.ground_truth)} for p in problems]


def wrong_answer(truth: str, rng: random.Random) -> str:
    """A plausible wrong answer: off by a little, a digit changed, or the sign flipped."""
    value = int(truth)
    kind = rng.randrange(3)
    if kind == 0:
        candidate = value + rng.choice([-1, 1]) * rng.randint(1, 10)
    elif kind == 1:
        digits = list(str(abs(value)))
        i = rng.randrange(len(digits))
        digits[i] = str((int(digits[i]) + rng.randint(1, 9)) % 10)
        candidate = int("".join(digits)) * (-1 if value < 0 else 1)
    else:
        candidate = -value if value != 0 else rng.randint(1, 9)
    return str(candidate) if candidate != value else str(value + 1)


def preference_pairs(problems: list[Problem], per_problem: int = 1, seed: int = 0) -> list[dict[str, str]]:
    """Rows `{prompt, chosen, rejected}`: the correct answer preferred over a wrong one.

    Used for Bradley-Terry reward-model training: loss = -log sigmoid(r(chosen) - r(rejected))
    (Ouyang et al. 2022, eq. 1).
    """
    rng = random.Random(seed)
    rows = []
    for p in problems:
        for _ in range(per_problem):
            rows.append(
                {
                    "prompt": p.prompt,
                    "chosen": response_text(p.ground_truth),
                    "rejected": response_text(wrong_answer(p.ground_truth, rng)),
                }
            )
    return rows


# ---- the Safe-RLHF cost signal ---------------------------------------------------------------
@dataclass(frozen=True)
class CostConfig:
    """What makes a response "unsafe" for the Safe-RLHF cost (a stand-in for harmfulness)."""

    forbidden: tuple[str, ...] = ("13",)
    """Regular expressions; a response matching any is unsafe. The default makes some correct
    answers (113, 213, 1300 ...) unsafe, so reward and cost genuinely conflict."""
    max_chars: int = 12
    """Length budget: a response longer than this (after stripping whitespace) is unsafe."""


def cost(response: str, cfg: CostConfig = CostConfig()) -> float:
    """1.0 if the response is unsafe (forbidden pattern or over the length budget), else 0.0.

    Safe-RLHF (Dai et al. 2023, sec. 3) reads cost > 0 as unsafe and constrains the expected
    cost of the policy; this is the rule-based ground truth a cost model learns to predict.
    """
    text = response.strip()
    if len(text) > cfg.max_chars:
        return 1.0
    return 1.0 if any(re.search(pattern, text) for pattern in cfg.forbidden) else 0.0


def is_safe(response: str, cfg: CostConfig = CostConfig()) -> bool:
    return cost(response, cfg) == 0.0


def cost_pairs(problems: list[Problem], cfg: CostConfig = CostConfig(), seed: int = 0) -> list[dict]:
    """Rows `{prompt, safer, more_costly, safer_is_safe, more_costly_is_safe}` for cost-model
    training (Safe-RLHF eq. 5: a pairwise ranking term plus a safety-sign term).

    The costly response pads an answer past the length budget; the safer one is the bare
    answer, which can itself be unsafe (a forbidden pattern), as in the real data.
    """
    rng = random.Random(seed)
    rows = []
    for p in problems:
        answer = rng.choice([p.ground_truth, wrong_answer(p.ground_truth, rng)])
        safer = response_text(answer)
        costly = safer + " " + "!" * (cfg.max_chars + 1)
        rows.append(
            {
                "prompt": p.prompt,
                "safer": safer,
                "more_costly": costly,
                "safer_is_safe": is_safe(safer, cfg),
                "more_costly_is_safe": is_safe(costly, cfg),
            }
        )
    return rows


def corpus(n: int = 2000, seed: int = 0) -> list[str]:
    """Full `prompt + answer` texts over a spread of difficulties (tokenizer training text)."""
    configs = [ArithmeticConfig(digits=d, operations=OPERATIONS, num_operands=k) for d in (1, 2, 3, 4) for k in (2, 3)]
    texts = []
    for i, cfg in enumerate(configs):
        for p in generate(cfg, n // len(configs), seed=seed + i):
            texts.append(p.prompt + response_text(p.ground_truth))
    return texts
