"""Reward functions: given as callables or by reference, called the way their signatures ask,
several of them weighted into one score.

    rewards = RewardSet.of(["my_rewards.py:correct", {"function": "mypkg.rewards:form", "weight": 0.2}])
    RuleReward(rewards)           # scored in the session's long-lived scoring processes

A reference is `path/to/file.py:function`, `package.module:function`, or a built-in name:
`math_verify` (math-verify's equivalence of the response's final answer and the ground truth),
`reasoning_gym` (the reasoning-gym dataset's own scorer) and the registered tasks' names
(`arithmetic`, ...). A function is called in one of two ways, chosen from its parameters:

    verl's      compute_score(data_source, solution_str, ground_truth, extra_info=None)
    the simple  fn(response, ground_truth, **row): further parameters are filled from the
                row's columns of the same name (`**kwargs` takes every column)

and returns a number (a bool counts; verl's dict return gives its "score"). A function with a
`fallback` scores that value on a row where it raised, returned something else or ran out of
time, and the row is counted (`reward/fallbacks`); without one the failure stops the call
with an error naming the function and the row.

This module imports only the standard library at the top: a jailed scorer receives it by value.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
RESERVED = {"fallbacks", "judge"}
"""Names a reward function may not have: the columns reward/fallbacks and reward/judge are taken."""


class RewardDefinitionError(ValueError):
    """A reward function that cannot be found or called as a reward; the message says which and how to fix it."""


class NotANumber(TypeError):
    """A reward function returned something other than a finite number."""


# ---- built-in rewards from the ecosystem's packages -----------------------------------------
def final_answer(response: str) -> str:
    """The answer a response gives: inside its last <answer>...</answer>, else the whole text."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(response)
    return (tagged if tagged is not None else response).strip()


def math_verify(response: str, ground_truth: str) -> float:
    """1.0 when math-verify finds the response's answer equal to the ground truth (LaTeX,
    fractions, sets, ... compared as mathematics), else 0.0."""
    import math_verify as mv

    truth = mv.parse(ground_truth if "$" in ground_truth else f"${ground_truth}$")
    return float(bool(truth) and mv.verify(truth, mv.parse(response)))


def reasoning_gym(response: str, ground_truth: str, question: str, metadata: dict) -> float:
    """The reasoning-gym dataset's own scorer (its `score_answer`) on the response's answer;
    the row comes from `data.source: reasoning_gym` (question, metadata kept as columns)."""
    from reasoning_gym import get_score_answer_fn

    entry = {"question": question, "answer": ground_truth, "metadata": metadata}
    return float(get_score_answer_fn(metadata["source_dataset"])(final_answer(response), entry))


BUILT_IN: dict[str, Callable[..., float]] = {"math_verify": math_verify, "reasoning_gym": reasoning_gym}


# ---- finding a function by reference ---------------------------------------------------------
def load_function(reference: str, where: str = "reward") -> Callable[..., Any]:
    """The function a reference names: a built-in, a registered task's name, or a file's or
    module's function (workbench.references: sent to the scoring processes by value when they
    cannot import it)."""
    from workbench.data.tasks import TASKS  # imported here: a jail receives this module by value
    from workbench.references import NotFound, find

    if reference in BUILT_IN:
        return BUILT_IN[reference]
    if reference in TASKS:
        return TASKS[reference].score
    if ":" not in reference:
        raise RewardDefinitionError(
            f"{where}: {reference!r} names no function; write `path/to/file.py:function` or "
            f"`package.module:function`, or a built-in: {sorted([*BUILT_IN, *TASKS])}"
        )
    try:
        fn = find(reference)
    except NotFound as error:
        raise RewardDefinitionError(f"{where}: {error}") from None
    if not callable(fn):
        raise RewardDefinitionError(f"{where}: {reference!r} is a {type(fn).__name__}, not a function")
    return fn


# ---- calling a function as a reward ----------------------------------------------------------
@dataclass
class RewardFunction:
    """One reward: a function, its name in metrics (`reward/<name>/mean`), its weight in the
    score, and what a row scores when it fails (None: the failure is an error)."""

    fn: Callable[..., Any]
    name: str = ""
    weight: float = 1.0
    fallback: float | None = None
    style: str = field(init=False, default="simple")
    """"verl" (compute_score's keywords) or "simple" (response, ground_truth, then row columns by name)."""
    columns: tuple[str, ...] | None = field(init=False, default=())
    """What is passed by name: the row's columns the simple style's parameters name (verl's
    style: the ones of its four it takes); None: every one (`**kwargs`)."""
    first_two: tuple[str, ...] = field(init=False, default=())
    """The simple style's first two parameters' names (never passed again as columns)."""

    def __post_init__(self):
        fn = self.fn
        self.name = self.name or getattr(fn, "__name__", "") or getattr(fn, "__qualname__", "") or type(fn).__name__
        if not math.isfinite(self.weight):
            raise RewardDefinitionError(f"reward {self.name}: weight {self.weight} is not a finite number")
        try:
            params = inspect.signature(self.fn).parameters
        except (TypeError, ValueError):
            return  # a builtin without a signature: called (response, ground_truth)
        names = list(params)
        kinds = [p.kind for p in params.values()]
        if "solution_str" in params:
            missing = [p for p in ("solution_str", "ground_truth") if p not in params]
            if missing:
                raise RewardDefinitionError(f"reward {self.name}: verl's signature needs {missing}: {VERL_PARAMS}")
            self.style = "verl"
            # verl's own scorers take only some of the four (gsm8k's: solution_str, ground_truth)
            self.columns = (
                None if inspect.Parameter.VAR_KEYWORD in kinds else tuple(p for p in VERL_PARAMS if p in params)
            )
            return
        positional = [n for n, k in zip(names, kinds) if k in (k.POSITIONAL_ONLY, k.POSITIONAL_OR_KEYWORD)]
        if len(positional) < 2 and inspect.Parameter.VAR_POSITIONAL not in kinds:
            raise RewardDefinitionError(
                f"reward {self.name}{inspect.signature(self.fn)}: a reward takes (response, ground_truth, **row) "
                f"or verl's compute_score{VERL_PARAMS}"
            )
        self.first_two = tuple(positional[:2])
        if inspect.Parameter.VAR_KEYWORD in kinds:
            self.columns = None
        else:
            self.columns = tuple(n for n in names[2:] if params[n].kind != params[n].VAR_POSITIONAL)

    def __call__(self, response: str, ground_truth: str, row: Mapping[str, Any]) -> float:
        if self.style == "verl":
            given = {
                "data_source": row.get("data_source"),
                "solution_str": response,
                "ground_truth": ground_truth,
                "extra_info": row.get("extra_info"),
            }
            value = self.fn(**{k: v for k, v in given.items() if self.columns is None or k in self.columns})
        else:
            if self.columns is None:  # **row: every column but those named like the first two parameters
                wanted = {k: v for k, v in row.items() if k not in self.first_two}
            else:
                wanted = {k: row[k] for k in self.columns if k in row}
            value = self.fn(response, ground_truth, **wanted)
        if isinstance(value, dict) and "score" in value:  # verl's functions may return a dict of scores
            value = value["score"]
        # A number of any kind (a bool, numpy's scalars, a 0-d tensor), never text
        number = None if isinstance(value, (str, bytes)) or not hasattr(value, "__float__") else float(value)
        if number is None or not math.isfinite(number):
            raise NotANumber(f"returned {value!r:.80}, not a finite number")
        return number


@dataclass
class RewardSet:
    """Several rewards, scored together on each row: the score is their weighted sum."""

    functions: list[RewardFunction]

    def __post_init__(self):
        names = [f.name for f in self.functions]
        if not names or len(set(names)) != len(names):
            raise RewardDefinitionError(f"rewards: give one or more, each with its own name (got {names})")
        if RESERVED & set(names):
            raise RewardDefinitionError(
                f"rewards: {sorted(RESERVED & set(names))} name the workbench's own columns (reward/fallbacks, "
                f"the judge's reward/judge): name the function otherwise (name: ...)"
            )

    @classmethod
    def of(cls, rewards: Any, where: str = "rewards") -> RewardSet:
        """A RewardSet from a callable, a reference, a RewardFunction, a mapping
        ({function, name, weight, fallback}), or a list of those."""
        if isinstance(rewards, RewardSet):
            return rewards
        items = list(rewards) if isinstance(rewards, Sequence) and not isinstance(rewards, str) else [rewards]
        return cls([_one(item, f"{where}[{i}]" if len(items) > 1 else where) for i, item in enumerate(items)])

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions]

    @property
    def fallbacks(self) -> bool:
        """Every function falls back on failure (so a row that ran out of time can be scored)."""
        return all(f.fallback is not None for f in self.functions)

    def total(self, values: Sequence[float]) -> float:
        return sum(f.weight * v for f, v in zip(self.functions, values))

    def __call__(self, response: str, ground_truth: str, row: Mapping[str, Any]) -> tuple[list[float], list[int]]:
        """Each function's value on one row, and which fell back; a failure without a fallback raises
        (its message names the function)."""
        values, failed = [], []
        for i, f in enumerate(self.functions):
            try:
                values.append(f(response, ground_truth, row))
            except Exception as error:
                if f.fallback is None:
                    what = str(error) if isinstance(error, NotANumber) else f"raised {error!r}"
                    raise RuntimeError(f"{f.name} {what}"[:2000]) from error
                values.append(f.fallback)
                failed.append(i)
        return values, failed


def _one(item: Any, where: str) -> RewardFunction:
    if isinstance(item, RewardFunction):
        return item
    if isinstance(item, str):
        return RewardFunction(load_function(item, where), name=_short(item))
    if isinstance(item, Mapping):
        unknown = set(item) - {"function", "name", "weight", "fallback"}
        if "function" not in item or unknown:
            raise RewardDefinitionError(f"{where}: give {{function, name, weight, fallback}}; got keys {sorted(item)}")
        fn = item["function"]
        return RewardFunction(
            load_function(fn, where) if isinstance(fn, str) else fn,
            name=item.get("name") or (_short(fn) if isinstance(fn, str) else ""),
            weight=float(item.get("weight", 1.0)),
            fallback=None if item.get("fallback") is None else float(item["fallback"]),
        )
    if callable(item):
        return RewardFunction(item)
    raise RewardDefinitionError(f"{where}: {item!r} is not a reward function, a reference or a mapping")


def _short(reference: str) -> str:
    """A reference's name in metrics: the function's name (`rewards.py:correct` -> correct)."""
    return reference.rpartition(":")[2] or reference


# Sent by value: a jailed scorer imports only the standard library and cloudpickle.
def _register() -> None:
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])


_register()
