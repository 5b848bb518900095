"""Human-readable plans: text tables and Gantt bars (call, devices, start, end) for widgets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workbench.planner.execution import Evaluation, ExecutionPlan
    from workbench.planner.plan import Plan

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


def _devs(lo: int, hi: int) -> str:
    return f"d{lo}" if hi - lo == 1 else f"d{lo}-{hi - 1}"


def _rows(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    line = fmt.format(*header)
    return "\n".join([line, "-" * len(line)] + [fmt.format(*map(str, r)) for r in rows])


def plan_table(plan: "Plan") -> str:
    """Placement, allocation, strategy and time per call, stage times and memory per device."""
    stage = plan.dataflow.stages()
    wl, c = plan.workload, plan.cluster
    head = (f"HybridFlow plan: {plan.dataflow.name} on {c.n_devices} x {c.name} "
            f"({c.n_nodes} node(s) x {c.devices_per_node})"
            + ("" if c.calibrated else "  [UNCALIBRATED cluster figures]") +
            f"\nworkload: batch {wl.global_batch}x{wl.n_samples}, prompt {wl.prompt_len}, "
            f"response {wl.response_len}, {wl.ppo_epochs} epoch(s) x {wl.ppo_mini_batches} "
            f"mini-batches")
    sets = _rows(
        ["colocated set", "devices", "per node", "models (train | gen layout)", "mem/device GB"],
        [[s.name, _devs(s.devices.start, s.devices.stop), list(s.devices_per_node),
          ", ".join(f"{m}:{a.strategy.short()}" + (f"|{a.generation.short()}" if a.generation else "")
                    for m, a in s.assignments.items()),
          f"{s.peak_memory / GB:.1f} / {c.device_memory / GB:.0f}"] for s in plan.sets])
    calls = _rows(
        ["call", "model", "kind", "stage", "set", "strategy", "est. s"],
        [[k.name, k.model, k.kind, stage[k.name], plan.set_of(k.model).name,
          plan.strategy_of(k.name).short(), f"{plan.call_times[k.name]:.2f}"]
         for k in plan.dataflow.calls])
    switches = [f"{m}: {a.transition.method} switch {a.strategy.short()} -> "
                f"{(a.generation or a.strategy).short()}, "
                f"{a.transition.comm_bytes / GB:.2f} GB moved/device, peak "
                f"{a.transition.peak_params / GB:.2f} GB params, redundancy "
                f"{a.transition.redundant / GB:.2f} GB"
                for s in plan.sets for m, a in s.assignments.items() if a.transition is not None]
    idle = plan.stats.get("idle_devices", 0)
    stages = "  ".join(f"stage {i}: {t:.2f}s" for i, t in enumerate(plan.stage_times))
    if switches or idle:
        sets += "\n" + "\n".join(switches + ([f"{idle} device(s) left idle: more would not be "
                                                f"faster"] if idle else []))
    tail = (f"{stages}\niteration: {plan.iteration_time:.2f}s   throughput: "
            f"{plan.throughput:,.0f} tokens/s")
    return "\n\n".join([head, sets, calls, tail])


def plan_gantt(plan: "Plan") -> list[GanttBar]:
    """Bars of one iteration under HybridFlow's stage model: stages one after another, sets in
    parallel, the calls of one set within a stage one after another (dataflow order)."""
    stage = plan.dataflow.stages()
    bars, t0 = [], 0.0
    for s_i, length in enumerate(plan.stage_times):
        for cs in plan.sets:
            t = t0
            for call in plan.dataflow.calls:
                if stage[call.name] == s_i and call.model in cs.models:
                    d = plan.call_times[call.name]
                    bars.append(GanttBar(call.name, call.name, "compute",
                                         (cs.devices.start, cs.devices.stop), t, t + d))
                    t += d
        t0 += length
    return bars


def execution_gantt(evaluation: "Evaluation", include_data: bool = False) -> list[GanttBar]:
    """Bars of a scored ReaLHF execution plan, in start order, over all unrolled iterations."""
    g, sch = evaluation.graph, evaluation.schedule
    bars = []
    for i, task in enumerate(g.tasks):
        if task.kind == "data" and not include_data:
            continue
        devs = (task.devices[0][0], max(h for _, h in task.devices)) if task.devices else (0, 0)
        bars.append(GanttBar(task.name.rsplit("@", 1)[0], task.call, task.kind, devs,
                             sch.start[i], sch.end[i], task.iteration))
    return sorted(bars, key=lambda b: (b.start, b.devices))


def execution_table(plan: "ExecutionPlan", evaluation: "Evaluation") -> str:
    """Mesh, strategy, start and end per call (all iterations), then time and MaxMem."""
    rows = [[b.label, b.iteration, _devs(*b.devices) if b.devices[1] else "-", b.kind,
             plan.layouts[b.call][1].short() if b.kind == "compute" else "",
             f"{b.start:.2f}", f"{b.end:.2f}"] for b in execution_gantt(evaluation)]
    body = _rows(["task", "iter", "devices", "kind", "strategy", "start s", "end s"], rows)
    return (f"{body}\n\nper iteration: {evaluation.time:.2f}s  (makespan "
            f"{evaluation.makespan:.2f}s)   MaxMem: {evaluation.max_mem / GB:.1f} GB"
            + ("  OUT OF MEMORY" if evaluation.oom else ""))
