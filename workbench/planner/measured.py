"""The planner's estimate beside what a run measured: seconds per call and per iteration.

    estimated = estimated_call_seconds(evaluation)              # a scored per-call plan
    measured = measured_call_seconds(session.trace(), estimated, last=2)
    check = compare(estimated, measured, evaluation.time, measured_iteration_s)
    print(check_table(check))

A call's measured seconds in one iteration: the spans of its step (`extra["step"]`, the
planner's call name) that run the step's worker method (`workbench.steps`), from the first
rank's start to the last rank's end. A weight push or hybrid-engine transition tagged with the
same step is left out: the estimate prices those as tasks of their own. A call queued behind
another on one process is counted from when it starts, not while it waits. Pure functions over
span records: nothing here needs Ray.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import TYPE_CHECKING

from workbench import steps
from workbench.planner.report import text_table

if TYPE_CHECKING:
    from workbench.planner.execution import Evaluation
    from workbench.tracing import CallRecord


def estimated_call_seconds(evaluation: Evaluation, iteration: int = 0) -> dict[str, float]:
    """Estimated seconds of each call in one iteration of a scored per-call plan, as the driver
    sees it (its dispatch included; a parameter reallocation before it is a task of its own)."""
    times: dict[str, float] = {}
    for task in evaluation.graph.tasks:
        if task.iteration == iteration and task.call is not None and task.kind in ("compute", "dispatch"):
            times[task.call] = times.get(task.call, 0.0) + task.cost
    return times


def call_spans(records: Iterable[CallRecord], calls: Iterable[str]) -> dict[str, dict[int, float]]:
    """Measured seconds of each call (a step name) in each iteration that ran it:
    {call: {iteration: seconds}}. Spans without an iteration tag (outside an algorithm) are
    left out."""
    methods = _worker_methods(calls)
    runs: dict[tuple[str, int, object], list[CallRecord]] = {}  # (call, iteration, driver call) -> spans
    for r in records:
        call, iteration = r.extra.get("step"), r.extra.get("iteration")
        if call in methods and iteration is not None and r.method.split(".")[-1] == methods[call]:
            runs.setdefault((call, iteration, r.extra.get("call", r.call_id)), []).append(r)
    seconds: dict[str, dict[int, float]] = {call: {} for call in methods}
    for (call, iteration, _), spans in runs.items():
        span = max(s.end for s in spans) - min(s.start for s in spans)
        seconds[call][iteration] = seconds[call].get(iteration, 0.0) + span
    return seconds


def measured_call_seconds(records: Iterable[CallRecord], calls: Iterable[str], last: int) -> dict[str, float]:
    """Median seconds of each call over the `last` iterations that ran it (the earlier ones
    warm up). A call no span shows is left out."""
    if last < 1:
        raise ValueError(f"measured_call_seconds: last must be at least 1 iteration, got {last}")
    per_iteration = call_spans(records, calls)
    return {
        call: statistics.median(by_it[i] for i in sorted(by_it)[-last:])
        for call, by_it in per_iteration.items()
        if by_it
    }


def compare(
    estimated_call_s: dict[str, float],
    measured_call_s: dict[str, float],
    estimated_iteration_s: float,
    measured_iteration_s: float,
) -> dict:
    """Estimate against measurement, rounded for a report: the iteration's seconds and error
    (estimate / measurement - 1) and, per call measured and estimated (in the measured
    order), {"estimated_s", "measured_s", "error"}."""
    if measured_iteration_s <= 0:
        raise ValueError(f"compare: measured_iteration_s must be positive, got {measured_iteration_s}")
    return {
        "estimated_iteration_s": round(estimated_iteration_s, 3),
        "measured_iteration_s": round(measured_iteration_s, 3),
        "iteration_error": round(estimated_iteration_s / measured_iteration_s - 1, 3),
        "per_call": {
            c: {
                "estimated_s": round(estimated_call_s[c], 4),
                "measured_s": round(m, 4),
                "error": round(estimated_call_s[c] / m - 1, 3),
            }
            for c, m in measured_call_s.items()
            if c in estimated_call_s and m > 0
        },
    }


def check_table(check: dict, where: dict[str, str] | None = None) -> str:
    """`compare`'s result as text: a row per call (and where it ran, when `where` names it),
    then the iteration."""
    where = where or {}
    header = ["call", *(["where"] if where else []), "estimated s", "measured s", "error"]
    rows = [
        [c, *([where.get(c, "")] if where else []), f"{v['estimated_s']:.3f}", f"{v['measured_s']:.3f}"]
        + [f"{v['error']:+.0%}"]
        for c, v in check["per_call"].items()
    ]
    iteration = ["iteration", *([""] if where else []), f"{check['estimated_iteration_s']:.3f}"]
    iteration += [f"{check['measured_iteration_s']:.3f}", f"{check['iteration_error']:+.0%}"]
    return text_table(header, rows + [iteration])


def _worker_methods(calls: Iterable[str]) -> dict[str, str]:
    """The worker method each call (a step name) runs; every call that is no worker step, named."""
    methods: dict[str, str] = {}
    unknown: list[str] = []
    for call in calls:
        method = getattr(steps.BY_NAME.get(call), "worker_method", None)
        if method is None:
            unknown.append(call)
        else:
            methods[call] = method
    if unknown:
        raise ValueError(
            f"call(s) {unknown} are not worker steps of workbench.steps, so no span measures them; "
            f"the worker steps: {[s.name for s in steps.STEPS if s.worker_method]}"
        )
    return methods
