"""Human-readable plans: text tables and Gantt bars (call, devices, start, end) for widgets.

The bars and table helpers here serve both kinds of plan: a searched ReaLHF execution plan
(below) and a HybridFlow `Plan` (its `table()` and `gantt()`, in `plan`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workbench.planner.execution import Evaluation, ExecutionPlan

GB = 1e9


@dataclass(frozen=True)
class GanttBar:
    """One bar of a timeline: what ran where and when (seconds from the iteration start)."""

    label: str
    """Call name, or a transfer task's label."""
    call: str | None
    """The call the bar belongs to (transfers: the call they feed)."""
    kind: str
    """'compute', 'param' (parameter transfer) or 'data' (data transfer)."""
    devices: tuple[int, int]
    """First device and one past the last (half-open); (0, 0) for a data transfer."""
    start: float
    end: float
    iteration: int = 0


def device_range(lo: int, hi: int) -> str:
    """Devices lo..hi-1 as 'd3' or 'd0-3'."""
    return f"d{lo}" if hi - lo == 1 else f"d{lo}-{hi - 1}"


def text_table(header: list[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned columns under a header and a rule (cells are shown with str())."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    line = fmt.format(*header)
    return "\n".join([line, "-" * len(line)] + [fmt.format(*map(str, r)) for r in rows])


def execution_gantt(evaluation: Evaluation, include_data: bool = False) -> list[GanttBar]:
    """Bars of a scored ReaLHF execution plan, in start order, over all unrolled iterations."""
    g, sch = evaluation.graph, evaluation.schedule
    bars = []
    for i, task in enumerate(g.tasks):
        if task.kind == "data" and not include_data:
            continue
        devs = (task.devices[0][0], max(h for _, h in task.devices)) if task.devices else (0, 0)
        bars.append(
            GanttBar(task.name.rsplit("@", 1)[0], task.call, task.kind, devs, sch.start[i], sch.end[i], task.iteration)
        )
    return sorted(bars, key=lambda b: (b.start, b.devices))


def execution_table(plan: ExecutionPlan, evaluation: Evaluation) -> str:
    """Mesh, strategy, start and end per call (all iterations), then time and MaxMem."""
    rows = [
        [
            b.label,
            b.iteration,
            device_range(*b.devices) if b.devices[1] else "-",
            b.kind,
            _strategy(plan, b),
            f"{b.start:.2f}",
            f"{b.end:.2f}",
        ]
        for b in execution_gantt(evaluation)
    ]
    body = text_table(["task", "iter", "devices", "kind", "strategy", "start s", "end s"], rows)
    return (
        f"{body}\n\nper iteration: {evaluation.time:.2f}s  (makespan "
        f"{evaluation.makespan:.2f}s)   MaxMem: {evaluation.max_mem / GB:.1f} GB"
        + ("  OUT OF MEMORY" if evaluation.oom else "")
    )


def _strategy(plan: ExecutionPlan, bar: GanttBar) -> str:
    """The parallel strategy of a compute bar's call; blank for transfers."""
    if bar.kind != "compute":
        return ""
    if bar.call is None:  # execution_gantt gives every compute task its call
        raise AssertionError(f"compute bar {bar.label!r} names no call")
    return plan.layouts[bar.call][1].short()
