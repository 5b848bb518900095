"""TimeCost: list scheduling of a task graph whose tasks occupy device ranges (ReaLHF §2).

A task may start when all its parents have ended and every device it occupies is free; tasks
on overlapping devices therefore never run at the same time, tasks on disjoint devices may.
Ready tasks are taken in order of ready time (ties: insertion order), and each one runs to
completion, exactly the ReaLHF estimator:

    v.start = max(v.ready, end of the last task on any of v's devices)
    v.end   = v.start + cost(v)

Keeping a "free at" time per device is the same as ReaLHF's rule of updating the last task
of every overlapping mesh.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workbench.planner.specs import ClusterSpec


@dataclass
class Task:
    """One node of a task graph."""

    name: str
    """Label, e.g. 'gen@1' or 'realloc actor train->gen@1'."""
    cost: float
    """Seconds."""
    devices: tuple[tuple[int, int], ...]
    """Half-open device ranges it occupies; () for a task that holds no device (a delay)."""
    parents: tuple[int, ...]
    """Indices of tasks that must end first."""
    kind: str = "compute"
    """'compute', 'param' (parameter transfer), 'data' (data transfer), 'driver' (its step
    between calls), 'dispatch' (its call overhead) or 'step' (a step's end, which the next
    step's calls wait for)."""
    call: str | None = None
    """The model function call it belongs to (for reports)."""
    iteration: int = 0


@dataclass
class TaskGraph:
    """Tasks in insertion order; parents must be added before children."""

    tasks: list[Task] = field(default_factory=list)

    def add(self, name: str, cost: float, devices=(), parents=(), **kw) -> int:
        devs = tuple(devices)
        if devs and isinstance(devs[0], int):  # a single (lo, hi) range
            devs = (devs,)
        for p in parents:
            if not 0 <= p < len(self.tasks):
                raise ValueError(f"task {name!r}: parent {p} is not an earlier task")
        self.tasks.append(Task(name, float(cost), devs, tuple(parents), **kw))
        return len(self.tasks) - 1


@dataclass
class Schedule:
    """Start and end of every task (indexed like the graph) and the makespan."""

    start: list[float]
    end: list[float]
    makespan: float


def time_cost(graph: TaskGraph, shared_cores: tuple[int, float] | None = None) -> Schedule:
    """List-schedule the graph; returns start/end per task and the makespan.

    shared_cores=(devices_per_node, cores_per_node): the devices of each machine time-share
    its cores (a CPU machine offering more logical devices than cores). Then a task on a
    machine with k busy devices progresses at min(1, cores/k) of its speed (processor
    sharing), so its cost is the seconds it would take alone."""
    if shared_cores is not None:
        return _shared_time_cost(graph, *shared_cores)
    tasks = graph.tasks
    n = len(tasks)
    n_dev = max((hi for t in tasks for _, hi in t.devices), default=0)
    free = [0.0] * n_dev
    waiting = [len(t.parents) for t in tasks]
    children: list[list[int]] = [[] for _ in range(n)]
    for i, t in enumerate(tasks):
        for p in t.parents:
            children[p].append(i)
    ready = [0.0] * n
    start, end = [0.0] * n, [0.0] * n
    heap = [(0.0, i) for i in range(n) if waiting[i] == 0]
    heapq.heapify(heap)
    done = 0
    while heap:
        r, i = heapq.heappop(heap)
        t = tasks[i]
        s = r
        for lo, hi in t.devices:
            s = max(s, max(free[lo:hi]))
        e = s + t.cost
        for lo, hi in t.devices:
            free[lo:hi] = [e] * (hi - lo)
        start[i], end[i] = s, e
        done += 1
        for c in children[i]:
            ready[c] = max(ready[c], e)
            waiting[c] -= 1
            if waiting[c] == 0:
                heapq.heappush(heap, (ready[c], c))
    if done != n:
        raise ValueError("task graph has a cycle")
    return Schedule(start, end, max(end, default=0.0))


def shared_cores(cluster: ClusterSpec) -> tuple[int, float] | None:
    """`time_cost`'s shared_cores for `cluster`: (devices, cores) per machine when its devices
    time-share fewer cores than they are (`ClusterSpec.cores_per_node`), else None."""
    c = cluster
    if c.cores_per_node is None or c.cores_per_node >= c.devices_per_node:
        return None
    return (c.devices_per_node, c.cores_per_node)


def concurrent_time(works: Sequence[tuple[float, tuple[int, int]]], shared: tuple[int, float] | None = None) -> float:
    """Seconds until all of `works` end when they start together, each (seconds alone, its
    [first, last) devices) on devices no other one uses: the longest, or with `shared` cores
    TimeCost's processor sharing. The auto-mapper prices the sets of one dependency level with
    it, so both planners slow concurrent work on shared cores by the same rule."""
    if shared is None:
        return max((w for w, _ in works), default=0.0)
    graph = TaskGraph()
    for seconds, devices in works:
        graph.add("concurrent", seconds, devices)
    return time_cost(graph, shared).makespan


def _shared_time_cost(graph: TaskGraph, devices_per_node: int, cores: float) -> Schedule:
    """The same list scheduling, simulated event by event with processor sharing. Ready tasks
    claim their devices in order of ready time; a task waiting for a device keeps later tasks
    off it, as above."""
    tasks = graph.tasks
    n = len(tasks)
    waiting = [len(t.parents) for t in tasks]
    children: list[list[int]] = [[] for _ in range(n)]
    for i, t in enumerate(tasks):
        for p in t.parents:
            children[p].append(i)
    devices = [[d for lo, hi in t.devices for d in range(lo, hi)] for t in tasks]
    start, end = [0.0] * n, [0.0] * n
    pending = [(0.0, i) for i in range(n) if waiting[i] == 0]
    running: dict[int, float] = {}  # task -> seconds of work left (at full speed)
    busy: set[int] = set()
    now, done = 0.0, 0
    while pending or running:
        pending.sort()
        claimed: set[int] = set()
        still: list[tuple[float, int]] = []
        for r, i in pending:
            if busy.isdisjoint(devices[i]) and claimed.isdisjoint(devices[i]):
                busy.update(devices[i])
                running[i], start[i] = tasks[i].cost, now
            else:
                claimed.update(devices[i])
                still.append((r, i))
        pending = still
        per_node: dict[int, int] = {}
        for d in busy:
            per_node[d // devices_per_node] = per_node.get(d // devices_per_node, 0) + 1
        rate = {i: min([1.0] + [cores / per_node[d // devices_per_node] for d in devices[i]]) for i in running}
        step = min((left / rate[i] for i, left in running.items()), default=0.0)
        now += step
        for i in list(running):
            running[i] -= rate[i] * step
            if running[i] <= 1e-12 * max(1.0, tasks[i].cost):
                del running[i]
                busy.difference_update(devices[i])
                end[i] = now
                done += 1
                for c in children[i]:
                    waiting[c] -= 1
                    if waiting[c] == 0:
                        pending.append((now, c))
    if done != n:
        raise ValueError("task graph has a cycle")
    return Schedule(start, end, max(end, default=0.0))
