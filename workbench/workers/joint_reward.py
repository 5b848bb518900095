"""Several scorers as one reward: an LLM judge (a worker group) beside rule rewards, each its own
call, launched together; the algorithm waits on them as one step, and their scores are summed
by weight when it collects them.

    groups.reward = JointReward([("judge", 1.0, judge_group), ("rules", 1.0, RuleReward([...]))])

Each scorer's score is kept as `reward/<name>` (a rule reward with several functions keeps its
own `reward/<function>` columns instead), rows that fell back are summed in `reward/fallbacks`,
and a scorer's other outputs (the judge's `judge_verdict`) ride along.
"""

from __future__ import annotations

from typing import Any

from workbench.data.batch import Batch
from workbench.errors import DispatchError

FALLBACKS = "reward/fallbacks"


class JointReward:
    """compute_reward(gen) on every scorer; their results as one future."""

    def __init__(self, scorers: list[tuple[str, float, Any]]):
        names = [name for name, _, _ in scorers]
        if not scorers or len(set(names)) != len(names):
            raise ValueError(f"JointReward: give one or more scorers, each with its own name (got {names})")
        self.scorers = scorers

    def compute_reward(self, gen) -> JointFuture:
        return JointFuture([(name, weight, scorer.compute_reward(gen)) for name, weight, scorer in self.scorers])

    def __repr__(self) -> str:
        return f"JointReward({', '.join(f'{n} x{w:g}' for n, w, _ in self.scorers)})"


class _Tags(dict):
    """The calls' trace tags as one dict: what the step clock adds reaches every call's spans."""

    def __init__(self, parts: list[dict]):
        super().__init__()
        self.parts = parts

    def update(self, *args, **kwargs) -> None:  # type: ignore[override]
        super().update(*args, **kwargs)
        for part in self.parts:
            part.update(*args, **kwargs)


class JointFuture:
    """The pending results of several scoring calls on the same rows."""

    def __init__(self, parts: list[tuple[str, float, Any]]):
        self.parts = parts
        self.outputs = [ref for _, _, f in parts for ref in f.outputs]
        self.metas = [ref for _, _, f in parts for ref in (f.metas or f.outputs)]
        self.trace_tags = _Tags([f.trace_tags for _, _, f in parts if getattr(f, "trace_tags", None) is not None])

    def get(self) -> Batch:
        results = [(name, weight, future.get()) for name, weight, future in self.parts]
        rows = {name: len(batch) for name, _, batch in results}
        if len(set(rows.values())) != 1:
            raise DispatchError(f"JointReward: the scorers answered for different numbers of rows: {rows}")
        total = sum(weight * batch["scores"].float() for _, weight, batch in results)
        out = Batch({"scores": total})
        fallbacks = None
        for name, _, batch in results:
            own = [k for k in batch.keys() if k.startswith("reward/") and k != FALLBACKS]
            for key in own or [f"reward/{name}"]:
                out[key] = batch[key] if own else batch["scores"].float()
            if FALLBACKS in batch.keys():
                fallbacks = batch[FALLBACKS] if fallbacks is None else fallbacks + batch[FALLBACKS]
            for key, column in batch.columns.items():  # e.g. the judge's verdicts
                out[key] = column
        if fallbacks is not None:
            out[FALLBACKS] = fallbacks
        return out
