"""ReaLHF execution plans: a device mesh and a strategy per model function call, scored on the
augmented dataflow graph (ReaLHF §1-§2 of the reference).

The graph unrolls `n_iterations` iterations so calls of consecutive iterations may overlap
when dependencies allow. Besides the calls it holds transfer tasks:
  * data transfers between a producer and a consumer on different meshes (hold no device);
  * parameter transfers into any call of a trained model whose layout differs from the
    model's home layout (its training call, which owns the optimizer states), after the
    previous iteration's update; they occupy the source and destination devices.
Frozen models live in the layout of their first call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from workbench.mesh import Mesh
from workbench.planner.errors import NoMeshError
from workbench.planner.memory import (
    generation_concurrency,
    generation_weights,
    inference_activations,
    kv_bytes_per_sequence,
    static_memory,
    train_activations,
    transition,
)
from workbench.planner.problem import Problem
from workbench.planner.schedule import Schedule, TaskGraph, shared_cores, time_cost
from workbench.planner.simulator import Simulator
from workbench.planner.specs import ClusterSpec
from workbench.planner.strategy import is_generation_layout


@dataclass(frozen=True, order=True)
class DeviceRange:
    """Contiguous devices [first, first + size) of the cluster (nodes are filled in order)."""

    first: int
    size: int

    @property
    def span(self) -> tuple[int, int]:
        return (self.first, self.first + self.size)

    def overlaps(self, other: DeviceRange) -> bool:
        return self.first < other.first + other.size and other.first < self.first + self.size

    def __str__(self) -> str:
        return f"d{self.first}" if self.size == 1 else f"d{self.first}-{self.first + self.size - 1}"


def valid_meshes(cluster: ClusterSpec) -> list[DeviceRange]:
    """ReaLHF meshes: an aligned slice of one machine whose size divides the machine, or
    k whole consecutive machines."""
    u, out = cluster.devices_per_node, []
    for size in cluster.mesh_sizes():
        step = size if size <= u else u
        out += [DeviceRange(f, size) for f in range(0, cluster.n_devices - size + 1, step)]
    return out


def mesh(cluster: ClusterSpec, size: int, first: int = 0) -> DeviceRange:
    """A validated mesh; raises NoMeshError for sizes or offsets no mesh has."""
    m = DeviceRange(first, size)
    if m not in set(valid_meshes(cluster)):
        raise NoMeshError(
            size, cluster.devices_per_node, cluster.mesh_sizes(), what=f"mesh of size {size} at device {first}:"
        )
    return m


@dataclass
class ExecutionPlan:
    """DeviceRange (which devices) and Mesh (their (pp, tp, dp) layout) for every call, by
    call name."""

    layouts: dict[str, tuple[DeviceRange, Mesh]]

    def describe(self) -> str:
        return ", ".join(f"{c}@{m}:{s.short()}" for c, (m, s) in self.layouts.items())


@dataclass
class Evaluation:
    """A scored execution plan."""

    time: float
    """Estimated seconds per iteration: makespan / iterations."""
    makespan: float
    max_mem: float
    """MaxMem: bytes on the fullest device (static + peak dynamic)."""
    cost: float
    """time, or time x OOM penalty x max_mem / device memory when it does not fit."""
    oom: bool
    graph: TaskGraph
    schedule: Schedule


class PlanEvaluator:
    """TimeCost and MaxMem of execution plans for one problem (dataflow, models, workload, cluster)."""

    def __init__(
        self, problem: Problem, n_iterations: int = 2, oom_penalty: float = 10.0, overlap_iterations: bool = False
    ):
        self.problem = problem
        self.flow, self.specs = problem.dataflow, problem.specs
        self.wl, self.cluster = problem.workload, problem.cluster
        self.n_iterations, self.oom_penalty = n_iterations, oom_penalty
        # overlap_iterations: one iteration's calls may start before the last one's have all
        # ended, as dependencies allow (ReaLHF's runtime and TimeCost). False (the workbench's
        # synchronous algorithms): `step` returns the updates' metrics before the driver issues
        # the next step, so every call of iteration k+1 waits for all of iteration k.
        self.overlap_iterations = overlap_iterations
        self.sim = Simulator(self.cluster, self.wl)
        self.train_call: dict[str, str] = {}
        for c in self.flow.calls:
            if c.kind == "train":
                if c.model in self.train_call:
                    raise ValueError(f"model {c.model!r} has two train calls; the planner supports one per iteration")
                self.train_call[c.model] = c.name

    def home(self, model: str, plan: ExecutionPlan) -> tuple[DeviceRange, Mesh]:
        call = self.train_call.get(model) or self.flow.calls_of(model)[0].name
        return plan.layouts[call]

    def memory(self, plan: ExecutionPlan) -> tuple[list[float], list[float], dict[str, float]]:
        """Static bytes per device, peak dynamic bytes per device, KV budget per generate call."""
        n, q = self.cluster.n_devices, self.cluster.device_memory
        static = [0.0] * n
        for m in self.flow.models:
            mesh_, s = self.home(m, plan)
            v = static_memory(
                self.specs[m], s, m in self.train_call, self.wl.param_sharding, self.wl.frozen_keep
            ).static
            for d in range(*mesh_.span):
                static[d] += v
        held = set()  # copies the runtime keeps between calls: static on their devices, once
        for c in self.flow.calls:
            mesh_, s = plan.layouts[c.name]
            copy = self._copy_of(c, plan)
            if copy in ("frozen", "rollout", "replica") and (c.model, mesh_, s) not in held:
                held.add((c.model, mesh_, s))
                spec = self.specs[c.model]
                # A replica holds FSDP shards (tensor-parallel pieces when tp > 1, whole on each
                # data-parallel replica); a frozen copy as frozen models are kept, a rollout
                # engine whole weights.
                if copy == "replica":
                    v = generation_weights(spec, s) / (s.dp if s.tp == 1 else 1)
                else:
                    v = static_memory(
                        spec, s, False, frozen_keep=self.wl.frozen_keep if copy == "frozen" else "whole"
                    ).params
                for d in range(*mesh_.span):
                    static[d] += v
        dyn, kv_budget = [0.0] * n, {}
        for c in self.flow.calls:
            mesh_, s = plan.layouts[c.name]
            spec = self.specs[c.model]
            copy = self._copy_of(c, plan)
            if copy == "switch":
                # The 3D-HybridEngine on the model's own devices: Table 2's resident weights
                # (shard + redundancy) replace the static training weights.
                home_s = self.home(c.model, plan)[1]
                home_params = static_memory(spec, home_s, True, self.wl.param_sharding).params
                extra = max(0.0, transition(spec, home_s, s, self.wl.transition).resident_params - home_params)
            elif copy == "realloc":  # reallocated in for the call (ReaLHF's runtime), given up after it
                extra = generation_weights(spec, s)
            else:  # the home, or a copy kept (static, above)
                extra = 0.0
            if c.kind == "train":
                need = train_activations(spec, s, self.wl) + extra
            elif c.kind == "inference":
                need = inference_activations(spec, s, self.wl) + extra
            else:
                per_seq = kv_bytes_per_sequence(spec, s, self.wl)
                # At least one sequence in flight; if even that does not fit, MaxMem says OOM.
                budget = max(per_seq, q - max(static[slice(*mesh_.span)]) - extra)
                kv_budget[c.name] = budget
                batch = math.ceil(self.wl.sequences * c.batch_factor / s.dp)
                conc = min(batch, generation_concurrency(spec, s, self.wl, budget))
                need = extra + conc * per_seq
            for d in range(*mesh_.span):
                if need > dyn[d]:
                    dyn[d] = need
        return static, dyn, kv_budget

    def _copy_of(self, c, plan: ExecutionPlan) -> str | None:
        """What the runtime runs call `c` on away from its model's home
        (`workbench.planner.call_groups`), or None at the home: "switch" (the hybrid engine's
        generation layout on the model's own devices), "frozen" (a frozen model's copy, loaded
        once), "rollout" (a rollout group, pushed after each update), "replica" (a trained
        model's data- or tensor-parallel copy for a call other than generation, reallocated into
        after each update) or "realloc" (a pipeline-parallel layout of a trained model, or a
        tensor-parallel generation layout apart from the hybrid engine, which only ReaLHF's
        runtime moves into, for the call)."""
        (home_mesh, home_s), (mesh_, s) = self.home(c.model, plan), plan.layouts[c.name]
        trained = c.model in self.train_call
        if (mesh_, s) == (home_mesh, home_s):
            return None
        if c.kind == "generate" and trained and mesh_ == home_mesh and is_generation_layout(home_s, s):
            return "switch"
        if not trained:
            return "frozen"
        if s.pp > 1 or (s.tp > 1 and c.kind == "generate"):
            return "realloc"
        return "rollout" if c.kind == "generate" else "replica"

    def call_cost(self, call_name: str, mesh_: DeviceRange, s: Mesh, kv_budget: float = float("inf")) -> float:
        c = self.flow.call(call_name)
        return self.sim.call_time(c, self.specs[c.model], s, kv_budget, c.model in self.train_call)

    def build_graph(self, plan: ExecutionPlan, kv_budget: dict[str, float]) -> TaskGraph:
        g, u = TaskGraph(), self.cluster.devices_per_node
        ids: dict[tuple[object, ...], int] = {}  # (call, iteration) or a weight push's key -> task id
        gathered = self.flow.driver_inputs()
        last_on: dict[int, int] = {}  # device -> the last call issued on it
        step_done: list[int] = []  # the driver has the last step's results (no overlap)
        for k in range(self.n_iterations):
            driver = None
            for c in self.flow.calls:
                mesh_, s = plan.layouts[c.name]
                parents = list(step_done)
                if c.kind == "train" and gathered:
                    if driver is None:  # the driver-side step (advantages), once per iteration
                        driver = g.add(
                            f"driver@{k}",
                            self.sim.driver_step_time(self.flow),
                            (),
                            [ids[d, k] for d in gathered],
                            kind="driver",
                            iteration=k,
                        )
                    parents.append(driver)
                for d in c.deps:
                    src_mesh = plan.layouts[d][0]
                    if src_mesh == mesh_:
                        parents.append(ids[d, k])
                        continue
                    cost = self.sim.data_transfer_time(
                        self.sim.output_bytes(self.flow.call(d)), _cross_nodes(src_mesh, mesh_, u)
                    )
                    parents.append(
                        g.add(f"data {d}->{c.name}@{k}", cost, (), [ids[d, k]], kind="data", call=c.name, iteration=k)
                    )
                parents += self._param_parents(g, ids, plan, c, k, step_done)
                cost = self.sim.call_time(
                    c, self.specs[c.model], s, kv_budget.get(c.name, float("inf")), c.model in self.train_call
                )
                if c.kind == "generate" and c.model in self.train_call and (mesh_, s) == self.home(c.model, plan):
                    # Same layout: the updated weights are still copied into the generation
                    # engine's buffer (weight sync); other layouts pay it in their realloc task.
                    cost += self.sim.reshard_time(self.specs[c.model], s, s)
                if self.cluster.call_overhead > 0:  # the driver's dispatch, before the call runs
                    cost -= self.cluster.call_overhead
                    parents = [
                        g.add(
                            f"dispatch {c.name}@{k}",
                            self.cluster.call_overhead,
                            (),
                            parents,
                            kind="dispatch",
                            call=c.name,
                            iteration=k,
                        )
                    ]
                # Calls on shared devices take turns in the order the algorithm issues them (the
                # dataflow's): a call waits for the last one issued on any of its devices.
                turns = sorted({last_on[d] for d in range(*mesh_.span) if d in last_on})
                ids[c.name, k] = g.add(f"{c.name}@{k}", cost, mesh_.span, parents + turns, call=c.name, iteration=k)
                last_on |= dict.fromkeys(range(*mesh_.span), ids[c.name, k])
            if not self.overlap_iterations and k + 1 < self.n_iterations:
                ends = [ids[c.name, k] for c in self.flow.calls]
                step_done = [g.add(f"step@{k} returns", 0.0, (), ends, kind="step", iteration=k)]
        return g

    def _param_parents(
        self, g: TaskGraph, ids: dict, plan: ExecutionPlan, c, k: int, step_done: list[int]
    ) -> list[int]:
        """Parameter-version edges: a call reads the weights of the previous update; a
        training call also waits for this iteration's readers of the old weights. A call away
        from its model's home first has the weights moved as the runtime moves them (see below),
        issued in its step (after `step_done`, the previous step's end, when steps do not overlap)."""
        m = c.model
        train = self.train_call.get(m)
        after = ([ids[train, k - 1]] if train and k > 0 else []) + step_done
        if c.name == train:
            readers = [ids[o.name, k] for o in self.flow.calls_of(m) if o.name != c.name and (o.name, k) in ids]
            return after + readers
        (src_mesh, src_s), (dst_mesh, dst_s) = self.home(m, plan), plan.layouts[c.name]
        copy = self._copy_of(c, plan)
        if copy is None:
            return after
        if copy == "frozen":
            return []  # a frozen model's copy holds its own weights: nothing moves per iteration
        devs = (src_mesh.span,) if src_mesh == dst_mesh else (src_mesh.span, dst_mesh.span)
        if copy == "switch":
            # The reallocation's special case the runtime runs here: the 3D-HybridEngine's
            # switch on the model's own devices (Table 2's bytes), as `memory` counts it.
            cost = self.sim.reshard_time(self.specs[m], src_s, dst_s)
        elif copy in ("rollout", "replica"):
            # A copy of a trained model, as the runtime makes one, brought up to date after each
            # update, once for every call that reads that copy: a rollout group as the workload
            # moves it (Workload.rollout_weights), a replica (other calls: the critic's values)
            # by reallocation from every home rank (a pipeline-parallel or DeepSpeed home's
            # broadcast: Workload.broadcast_homes).
            key = ("push", m, dst_mesh, dst_s, k)
            if key not in ids:
                crosses = _cross_nodes(src_mesh, dst_mesh, self.cluster.devices_per_node)
                if copy == "rollout":
                    cost = self.sim.rollout_push_time(self.specs[m], src_s, dst_s, crosses, m)
                    label = "realloc" if self.sim.rollout_reallocates(self.specs[m], src_s, m) else "push"
                elif src_s.pp > 1 or m in self.wl.broadcast_homes:  # these homes broadcast (WeightLink)
                    cost, label = self.sim.weight_push_time(self.specs[m], src_s, dst_s, crosses), "push"
                else:
                    cost, label = self.sim.replica_realloc_time(self.specs[m], src_s, dst_s, crosses), "realloc"
                ids[key] = g.add(
                    f"{label} {m}->{dst_mesh}@{k}", cost, devs, after, kind="param", call=c.name, iteration=k
                )
            return [ids[key]]
        else:  # a layout only ReaLHF's runtime moves into: its layer-by-layer reallocation
            cost = self.sim.realloc_time(self.specs[m], src_s, src_mesh.span, dst_s, dst_mesh.span)
        return [g.add(f"realloc {m}->{c.name}@{k}", cost, devs, after, kind="param", call=c.name, iteration=k)]

    def evaluate(self, plan: ExecutionPlan) -> Evaluation:
        static, dyn, kv_budget = self.memory(plan)
        max_mem = max(a + b for a, b in zip(static, dyn))
        graph = self.build_graph(plan, kv_budget)
        sched = time_cost(graph, shared_cores(self.cluster))
        t = sched.makespan / self.n_iterations
        q = self.cluster.device_memory
        oom = max_mem > q
        cost = t * self.oom_penalty * max_mem / q if oom else t
        return Evaluation(t, sched.makespan, max_mem, cost, oom, graph, sched)


def _cross_nodes(a: DeviceRange, b: DeviceRange, devices_per_node: int) -> bool:
    """Whether the devices two meshes span together are on more than one machine."""
    lo, hi = min(a.first, b.first), max(a.span[1], b.span[1])
    return lo // devices_per_node != (hi - 1) // devices_per_node
