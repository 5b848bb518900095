"""A HybridFlow plan: placement (colocated sets), allocation (devices per set) and strategies.

`Plan.deploy` runs it (see `deploy`): every colocated set becomes one resource pool, every
model in it one worker group on that pool with its (pp, tp, dp) layout, and the actor's
hybrid engine gets the generation layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workbench.controller.mesh import Mesh
from workbench.planner.dataflow import Dataflow
from workbench.planner.memory import MemoryBreakdown, Transition
from workbench.planner.specs import ClusterSpec, ModelSpec, Workload


@dataclass(frozen=True)
class ModelAssignment:
    """One model's layout inside its colocated set."""

    model: str
    """Role name ('actor', 'critic', ...)."""
    spec: ModelSpec
    """Architecture."""
    strategy: Mesh
    """Layout for training and inference calls (its world = the set's device count)."""
    generation: Mesh | None = None
    """Actor only: 3D-HybridEngine generation layout (p_g, t_g, d_g·d) on the same devices."""
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    """Per-device static memory plus the peak dynamic memory of this model's calls."""
    transition: Transition | None = None
    """Actor only: the training -> generation switch (HybridFlow Table 2 bytes and memory)."""


@dataclass(frozen=True)
class ColocatedSet:
    """Models that time-share the same devices (one resource pool)."""

    name: str
    """Pool name, e.g. 'actor+reference'."""
    models: tuple[str, ...]
    """Roles in the set, in dataflow order."""
    first_device: int
    """Global index of the set's first device (sets are packed node by node)."""
    n_devices: int
    """Devices allocated to the set."""
    devices_per_node: tuple[int, ...]
    """Devices taken on each machine the set touches: `ResourcePool(devices_per_node=...)`."""
    nodes: tuple[int, ...]
    """Indices of those machines."""
    assignments: dict[str, ModelAssignment]
    """Layout per model."""
    peak_memory: float
    """Per-device peak: static memory of all models + the largest call's dynamic memory."""

    @property
    def devices(self) -> range:
        return range(self.first_device, self.first_device + self.n_devices)


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
    stage_times: tuple[float, ...]
    """d_cost per stage: max over sets of the sum of their calls in the stage."""
    iteration_time: float
    """Sum of stage times: the estimated seconds per iteration."""
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
        raise KeyError(f"model {model!r} is not in the plan; models: "
                       f"{[m for s in self.sets for m in s.models]}")

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
        from workbench.planner.report import plan_table
        return plan_table(self)

    def gantt(self) -> list:
        from workbench.planner.report import plan_gantt
        return plan_gantt(self)

    def to_pools(self, session) -> dict:
        """Reserve one pool per colocated set on a live Session; returns {model: (pool, mesh)}
        ready for `session.group(model, WorkerClass, pool, config, mesh=mesh)`."""
        from workbench.planner.deploy import to_pools
        return to_pools(self, session)

    def deploy(self, session, workers: dict) -> dict:
        """Pools, layouts and worker groups of this plan on a live Session: `workers` maps
        each model to (Worker class, config); returns {model: WorkerGroup}."""
        from workbench.planner.deploy import deploy
        return deploy(self, session, workers)

    def to_execution_plan(self):
        """The same placement as a ReaLHF execution plan (mesh + strategy per call), to be
        scored by TimeCost / MaxMem next to searched plans."""
        from workbench.planner.execution import ExecutionPlan, DeviceMesh
        layouts = {}
        for c in self.dataflow.calls:
            s = self.set_of(c.model)
            layouts[c.name] = (DeviceMesh(s.first_device, s.n_devices), self.strategy_of(c.name))
        return ExecutionPlan(layouts)


def span(first: int, k: int, devices_per_node: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """First device, per-node counts and node indices of k devices starting at device `first`."""
    counts, nodes, d = [], [], first
    while d < first + k:
        node = d // devices_per_node
        take = min(first + k, (node + 1) * devices_per_node) - d
        counts.append(take)
        nodes.append(node)
        d += take
    return first, tuple(counts), tuple(nodes)


def pack_sets(sizes: list[int], devices_per_node: int) -> list[tuple[int, tuple[int, ...],
                                                                     tuple[int, ...]]]:
    """First device, per-node counts and node indices of sets laid out one after another."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [span(start, n, devices_per_node) for start, n in zip(starts, sizes)]
