"""A HybridFlow plan: placement (colocated sets), allocation (devices per set) and strategies,
with the estimated time of every call; its text table and Gantt bars.

`workbench.deploy.plans.deploy_plan` runs it: every colocated set becomes one resource pool,
every model in it one worker group on that pool with its (pp, tp, dp) layout, and the actor's
hybrid engine gets the generation layout.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from workbench.mesh import Mesh
from workbench.planner.asynchronous import COST_MODEL, AsyncEstimate, Sharing, estimate, steady_iteration
from workbench.planner.dataflow import Dataflow
from workbench.planner.errors import PlannerError
from workbench.planner.execution import DeviceRange, ExecutionPlan
from workbench.planner.placement import ColocatedSet, ModelAssignment  # noqa: F401  (ModelAssignment: older imports)
from workbench.planner.report import GB, GanttBar, device_range, text_table
from workbench.planner.specs import ClusterSpec, Workload


@dataclass
class Plan:
    """The result of HybridFlow auto-mapping (Alg. 1) for one dataflow on one cluster."""

    dataflow: Dataflow
    cluster: ClusterSpec
    workload: Workload
    sets: tuple[ColocatedSet, ...]
    """Colocated sets with their devices and layouts."""
    call_times: dict[str, float]
    """Estimated seconds per call (the actor's generation includes resharding)."""
    level_times: tuple[float, ...]
    """d_cost per dependency level (Dataflow.levels; HybridFlow's stages): max over sets of
    the sum of their calls in the level."""
    iteration_time: float
    """Sum of level times: the estimated seconds per iteration."""
    stats: dict = field(default_factory=dict)
    """Search statistics: placements, allocations evaluated, seconds."""

    @property
    def placement(self) -> tuple[tuple[str, ...], ...]:
        return tuple(s.models for s in self.sets)

    @property
    def allocation(self) -> tuple[int, ...]:
        return tuple(s.n_devices for s in self.sets)

    @property
    def throughput(self) -> float:
        """Tokens (prompt + response) of the global batch per second (HybridFlow §8)."""
        wl = self.workload
        return wl.sequences * wl.seq_len / self.iteration_time

    def set_of(self, model: str) -> ColocatedSet:
        for s in self.sets:
            if model in s.models:
                return s
        raise KeyError(f"model {model!r} is not in the plan; models: {[m for s in self.sets for m in s.models]}")

    def strategy_of(self, call: str) -> Mesh:
        c = self.dataflow.call(call)
        a = self.set_of(c.model).assignments[c.model]
        return a.generation if c.kind == "generate" and a.generation else a.strategy

    @property
    def peak_memory(self) -> float:
        return max(s.peak_memory for s in self.sets)

    def describe(self) -> str:
        """One line: placement, allocation and estimated iteration time."""
        parts = [f"{'+'.join(s.models)}:{s.n_devices}" for s in self.sets]
        return f"[{' | '.join(parts)}] {self.iteration_time:.1f}s/iter"

    def table(self) -> str:
        return plan_table(self)

    def gantt(self) -> list[GanttBar]:
        return plan_gantt(self)

    def to_dict(self, name: str = "") -> dict:
        """Plain values (YAML-writable): every colocated set's devices and its models' layouts (the
        actor's generation layout too), with the estimate for the reader. `plan_io.plan_from_dict`
        reads them back (or a plan written by hand in that form) and prices them."""
        if isinstance(self, AsyncPlan):
            raise PlannerError("an asynchronous plan (AsyncPlan) has no YAML form yet: write its synchronous split")
        sets = []
        for s in self.sets:
            models = {}
            for m, a in s.assignments.items():
                entry: dict = _layout(a.strategy)
                if a.generation is not None:
                    entry["generation"] = _layout(a.generation)
                models[m] = entry
            sets.append({"devices": s.n_devices, "first_device": s.first_device, "models": models})
        return {
            **({"name": name} if name else {}),
            "sets": sets,
            "estimated_iteration_s": round(self.iteration_time, 6),
        }

    def to_execution_plan(self) -> ExecutionPlan:
        """The same placement as a ReaLHF execution plan (mesh + strategy per call), to be
        scored by TimeCost / MaxMem next to searched plans."""
        layouts = {}
        for c in self.dataflow.calls:
            s = self.set_of(c.model)
            layouts[c.name] = (DeviceRange(s.first_device, s.n_devices), self.strategy_of(c.name))
        return ExecutionPlan(layouts)


@dataclass
class AsyncPlan(Plan):
    """A split plan run asynchronously (`automap_async`): generation on a rollout set of its
    own overlapping the trainer's sets, `iteration_time` the steady state of the asynchronous
    iteration model (`asynchronous`); `level_times` are those of the same plan run synchronously
    (without the push)."""

    max_staleness: int = 1
    generation_time: float = 0.0
    """G: the rollout set's calls (generation), seconds."""
    trainer_time: float = 0.0
    """T: the trainer's sets, their calls by dependency level (d_cost with the driver's step,
    `AutoMapper.level_times`), seconds."""
    push_time: float = 0.0
    """W: the weight push from `source` to the rollout after each update (Simulator.rollout_push_time)."""
    rollout: str = "rollout"
    """The rollout role (Dataflow.with_rollout)."""
    source: str = "actor"
    """The trained model whose weights the rollout takes."""
    sharing: Sharing | None = None
    """How both sides share one machine's cores while they overlap (None: they do not)."""

    @property
    def synchronous_time(self) -> float:
        """The same plan run synchronously (max_staleness=0): G + T + W."""
        return self.generation_time + self.trainer_time + self.push_time

    def iteration_model(self, iterations: int = 1) -> AsyncEstimate:
        """The iteration model of this plan over `iterations` iterations (from the cost model)."""
        return estimate(
            self.generation_time,
            self.trainer_time,
            self.push_time,
            self.max_staleness,
            iterations,
            sharing=self.sharing,
            source=COST_MODEL,
        )

    def with_staleness(self, max_staleness: int) -> AsyncPlan:
        """The same placement, allocation and layouts under another bound."""
        t = steady_iteration(
            self.generation_time, self.trainer_time, self.push_time, max_staleness, sharing=self.sharing
        )
        return dataclasses.replace(self, max_staleness=max_staleness, iteration_time=t)

    def describe(self) -> str:
        return f"{super().describe()} (max_staleness {self.max_staleness}; synchronous {self.synchronous_time:.1f}s)"

    def table(self) -> str:
        e = self.iteration_model()
        return (
            plan_table(self) + f"\nasynchronous, max_staleness {self.max_staleness}: generation {e.generate_s:.2f}s on "
            f"{self.set_of(self.rollout).name} | trainer {e.train_s:.2f}s | push {e.push_s:.2f}s "
            f"({self.source} -> {self.rollout}): {e.iteration_s:.2f}s per iteration in steady state "
            f"(synchronous split: {e.sequential_s:.2f}s); {e.bottleneck}-bound, rollout idle "
            f"{e.idle_rollout:.0%}, trainer idle {e.idle_trainer:.0%}"
        )

    def gantt(self) -> list[GanttBar]:
        return async_gantt(self)


def _layout(mesh: Mesh) -> dict[str, int]:
    return {"pp": mesh.pp, "tp": mesh.tp, "dp": mesh.dp}


def async_gantt(plan: AsyncPlan) -> list[GanttBar]:
    """Bars of one steady-state iteration of an asynchronous plan, from the end of one push to the
    end of the next: the rollout set generates the batch ahead while the trainer's sets run this
    batch's calls (levels one after another, as in `plan_gantt`), then the push holds the source's
    set and the rollout set. At max_staleness 0 the three follow one another."""
    level = plan.dataflow.levels()
    rollout = plan.set_of(plan.rollout)
    source = plan.set_of(plan.source)
    bars: list[GanttBar] = []
    t = 0.0
    for call in plan.dataflow.calls_of(plan.rollout):
        d = plan.call_times[call.name]
        bars.append(GanttBar(call.name, call.name, "compute", (rollout.devices.start, rollout.devices.stop), t, t + d))
        t += d
    t0 = plan.generation_time if plan.max_staleness == 0 else 0.0
    trainer_sets = [s for s in plan.sets if s is not rollout]
    for k in range(plan.dataflow.n_levels):
        length = 0.0
        for cs in trainer_sets:
            t = t0
            for call in plan.dataflow.calls:
                if level[call.name] == k and call.model in cs.models:
                    d = plan.call_times[call.name]
                    bars.append(
                        GanttBar(call.name, call.name, "compute", (cs.devices.start, cs.devices.stop), t, t + d)
                    )
                    t += d
            length = max(length, t - t0)
        t0 += length
    start = plan.iteration_time - plan.push_time
    for cs in (source, rollout):
        bars.append(
            GanttBar("push weights", None, "param", (cs.devices.start, cs.devices.stop), start, start + plan.push_time)
        )
    return bars


def plan_table(plan: Plan) -> str:
    """Placement, allocation, strategy and time per call, level times and memory per device."""
    level = plan.dataflow.levels()
    wl, c = plan.workload, plan.cluster
    head = (
        f"HybridFlow plan: {plan.dataflow.name} on {c.n_devices} x {c.name} "
        f"({c.n_nodes} node(s) x {c.devices_per_node})"
        + ("" if c.calibrated else "  [UNCALIBRATED cluster figures]")
        + f"\nworkload: batch {wl.batch_size}x{wl.n}, prompt {wl.prompt_len}, "
        f"response {wl.max_new_tokens}, {wl.epochs} epoch(s) x {wl.mini_batches} "
        f"mini-batches"
    )
    sets = text_table(
        ["colocated set", "devices", "per node", "models (train | gen layout)", "mem/device GB"],
        [
            [
                s.name,
                device_range(s.devices.start, s.devices.stop),
                list(s.devices_per_node),
                ", ".join(
                    f"{m}:{a.strategy.short()}" + (f"|{a.generation.short()}" if a.generation else "")
                    for m, a in s.assignments.items()
                ),
                f"{s.peak_memory / GB:.1f} / {c.device_memory / GB:.0f}",
            ]
            for s in plan.sets
        ],
    )
    calls = text_table(
        ["call", "model", "kind", "level", "set", "strategy", "est. s"],
        [
            [
                k.name,
                k.model,
                k.kind,
                level[k.name],
                plan.set_of(k.model).name,
                plan.strategy_of(k.name).short(),
                f"{plan.call_times[k.name]:.2f}",
            ]
            for k in plan.dataflow.calls
        ],
    )
    switches = [
        f"{m}: {a.transition.method} switch {a.strategy.short()} -> "
        f"{(a.generation or a.strategy).short()}, "
        f"{a.transition.comm_bytes / GB:.2f} GB moved/device, peak "
        f"{a.transition.peak_params / GB:.2f} GB params, redundancy "
        f"{a.transition.redundant / GB:.2f} GB"
        for s in plan.sets
        for m, a in s.assignments.items()
        if a.transition is not None
    ]
    idle = plan.stats.get("idle_devices", 0)
    levels = "  ".join(f"level {i}: {t:.2f}s" for i, t in enumerate(plan.level_times))
    if switches or idle:
        sets += "\n" + "\n".join(switches + ([f"{idle} device(s) left idle: more would not be faster"] if idle else []))
    tail = f"{levels}\niteration: {plan.iteration_time:.2f}s   throughput: {plan.throughput:,.0f} tokens/s"
    return "\n\n".join([head, sets, calls, tail])


def plan_gantt(plan: Plan) -> list[GanttBar]:
    """Bars of one iteration under HybridFlow's stage model: dependency levels one after
    another, sets in parallel, the calls of one set within a level one after another (dataflow order)."""
    level = plan.dataflow.levels()
    bars, t0 = [], 0.0
    for s_i, length in enumerate(plan.level_times):
        in_level = {
            cs.name: [c for c in plan.dataflow.calls if level[c.name] == s_i and c.model in cs.models]
            for cs in plan.sets
        }
        longest = max((sum(plan.call_times[c.name] for c in calls) for calls in in_level.values()), default=0.0)
        # A level's priced length can exceed its longest set's calls (sets slowing each other on
        # shared cores, the driver's step before training): its calls are drawn stretched to it.
        stretch = length / longest if longest > 0 else 1.0
        for cs in plan.sets:
            t = t0
            for call in in_level[cs.name]:
                d = plan.call_times[call.name] * stretch
                bars.append(GanttBar(call.name, call.name, "compute", (cs.devices.start, cs.devices.stop), t, t + d))
                t += d
        t0 += length
    return bars
