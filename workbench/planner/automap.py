"""HybridFlow auto device mapping (paper §6, Algorithm 1; auto_parallel from Appendix C, Alg. 2).

  for each placement (set partition of the models):
      A_min = least devices per colocated set that fit the set's memory
      for each allocation (integer composition of N with parts >= A_min):
          auto_parallel every model on its set's devices (cached per (model, devices))
          d_cost = sum over stages of (max over sets of (sum of the set's calls in the stage))
  keep the cheapest.

Auto-parallel picks the fastest (p, t, d) that fits; for the actor, the training layout first,
then the generation layout (p_g | p, t_g | t) with the fastest generation in the memory left.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from workbench.planner.dataflow import Dataflow
from workbench.planner.errors import ModelDoesNotFitError, NoFeasiblePlanError
from workbench.planner.memory import (MemoryBreakdown, generation_concurrency, generation_weights,
                                      inference_activations, kv_bytes_per_sequence,
                                      min_static_memory, static_memory, train_activations)
from workbench.planner.plan import ColocatedSet, ModelAssignment, Plan, pack_sets
from workbench.planner.simulator import INF, Simulator
from workbench.planner.specs import ClusterSpec, ModelSpec, Workload
from workbench.planner.strategy import ParallelStrategy, generation_strategies, strategies


def set_partitions(items: Sequence[str]) -> Iterator[tuple[tuple[str, ...], ...]]:
    """Every partition of `items` into non-empty blocks (Bell(n) of them: 15 for 4)."""
    items = list(items)
    if not items:
        yield ()
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield ((first,),) + part
        for i in range(len(part)):
            yield part[:i] + ((first,) + part[i],) + part[i + 1:]


def compositions(total: int, minimums: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every way to write `total` as ordered parts with part i >= minimums[i]; with all
    minimums 1 there are C(total-1, k-1) (stars and bars)."""
    k = len(minimums)
    free = total - sum(minimums)
    if k == 0 or free < 0:
        return
    for cuts in itertools.combinations(range(free + k - 1), k - 1):
        prev, parts = -1, []
        for c in cuts:
            parts.append(c - prev - 1)
            prev = c
        parts.append(free + k - 2 - prev)
        yield tuple(p + m for p, m in zip(parts, minimums))


def d_cost(stage_costs: Sequence[Sequence[float]]) -> float:
    """Iteration cost from per-set stage costs (HybridFlow Alg. 1): stage_costs[j][s] is the
    sum of set j's calls in stage s; sets run in parallel (max), stages in sequence (sum)."""
    return sum(max(col) for col in zip(*stage_costs))


@dataclass(frozen=True)
class ModelChoice:
    """auto_parallel's answer for one model on n devices under a memory budget."""

    strategy: ParallelStrategy
    generation: ParallelStrategy | None
    call_times: dict[str, float]
    static: MemoryBreakdown
    dynamic: float
    """Peak per-device dynamic bytes over the model's calls."""


class AutoMapper:
    """Holds the caches of one auto-mapping run; `run()` returns the best Plan."""

    def __init__(self, dataflow: Dataflow, specs: dict[str, ModelSpec], workload: Workload,
                 cluster: ClusterSpec, max_tp: int | None = None, max_pp: int | None = None):
        self.flow, self.specs, self.wl, self.cluster = dataflow, specs, workload, cluster
        self.max_tp, self.max_pp = max_tp, max_pp
        self.sim = Simulator(cluster, workload)
        self.stage = dataflow.stages()
        self.n_stages = dataflow.n_stages
        self._ranked: dict[tuple[str, int], list] = {}
        self._choice: dict[tuple[str, int, int], ModelChoice | None] = {}
        self._sets: dict[tuple[tuple[str, ...], int], tuple | None] = {}

    # --- auto_parallel (Alg. 2) ----------------------------------------------------------------
    def _ranked_strategies(self, model: str, n: int) -> list:
        """(time of non-generation calls, bytes needed, strategy, call times), fastest first;
        cached per (model, device count) as in the paper."""
        key = (model, n)
        if key not in self._ranked:
            spec, trained = self.specs[model], self.flow.trained(model)
            calls = [c for c in self.flow.calls_of(model) if c.kind != "generate"]
            rows = []
            for s in strategies(spec, n, self.cluster.devices_per_node):
                if s.tp > (self.max_tp or s.tp) or s.pp > (self.max_pp or s.pp):
                    continue
                times = {c.name: self.sim.call_time(c, spec, s) for c in calls}
                dyn = max([train_activations(spec, s, self.wl) if c.kind == "train" else
                           inference_activations(spec, s, self.wl) for c in calls], default=0.0)
                rows.append((sum(times.values()), static_memory(spec, s, trained), dyn, s, times))
            rows.sort(key=lambda r: (r[0], r[3]))
            self._ranked[key] = rows
        return self._ranked[key]

    def auto_parallel(self, model: str, n: int, budget: float) -> ModelChoice | None:
        """Fastest layout of `model` on n devices whose per-device memory fits `budget`."""
        key = (model, n, int(budget // 2**20))
        if key in self._choice:
            return self._choice[key]
        gen_calls = [c for c in self.flow.calls_of(model) if c.kind == "generate"]
        choice = None
        for _, static, dyn, s, times in self._ranked_strategies(model, n):
            if static.static + dyn > budget:
                continue
            if not gen_calls:
                choice = ModelChoice(s, None, dict(times), static, dyn)
                break
            gen = self._generation(model, s, budget - static.static)
            if gen is not None:
                g, gen_times, gen_dyn = gen
                choice = ModelChoice(s, g, {**times, **gen_times}, static, max(dyn, gen_dyn))
                break
        self._choice[key] = choice
        return choice

    def _generation(self, model: str, train: ParallelStrategy, free: float):
        """Fastest generation layout for a training layout, KV cache in the `free` bytes."""
        spec = self.specs[model]
        best = None
        for g in generation_strategies(train):
            kv_budget = free - generation_weights(spec, g)
            if kv_budget <= 0:
                continue
            times, total = {}, 0.0
            for c in self.flow.calls_of(model):
                if c.kind == "generate":
                    t = self.sim.generate(spec, g, kv_budget, c.batch_factor) \
                        + self.sim.reshard_time(spec, train, g)
                    times[c.name] = t
                    total += t
            if total < INF and (best is None or total < best[0]):
                batch = math.ceil(self.wl.sequences / g.dp)
                conc = min(batch, generation_concurrency(spec, g, self.wl, kv_budget))
                dyn = generation_weights(spec, g) + conc * kv_bytes_per_sequence(spec, g, self.wl)
                best = (total, g, times, dyn)
        return None if best is None else best[1:]

    # --- colocated sets ------------------------------------------------------------------------
    def set_cost(self, models: tuple[str, ...], n: int):
        """(stage costs, choices, peak memory) of a colocated set on n devices, or None when it
        does not fit. Budgets start from the others' sharded floor and are tightened to their
        chosen layouts until the whole set fits (at most three rounds)."""
        key = (models, n)
        if key in self._sets:
            return self._sets[key]
        q = self.cluster.device_memory
        static_of = {m: min_static_memory(self.specs[m], n, self.flow.trained(m)) for m in models}
        result = None
        if sum(static_of.values()) < q:
            for _ in range(3):
                choices = {}
                for m in models:
                    budget = q - sum(v for o, v in static_of.items() if o != m)
                    choices[m] = self.auto_parallel(m, n, budget)
                    if choices[m] is None:
                        break
                else:
                    static = sum(c.static.static for c in choices.values())
                    peak = static + max(c.dynamic for c in choices.values())
                    if peak <= q:
                        stages = [0.0] * self.n_stages
                        for c in choices.values():
                            for call, t in c.call_times.items():
                                stages[self.stage[call]] += t
                        result = (tuple(stages), choices, peak)
                        break
                    static_of = {m: choices[m].static.static for m in models}
                    continue
                break
        self._sets[key] = result
        return result

    def min_devices(self, models: tuple[str, ...], n_max: int) -> int | None:
        """A_min: the least device count on which the set fits (None if none up to n_max)."""
        for n in range(1, n_max + 1):
            if self.set_cost(models, n) is not None:
                return n
        return None

    # --- Algorithm 1 ---------------------------------------------------------------------------
    def check_each_model_fits(self) -> None:
        n, q = self.cluster.n_devices, self.cluster.device_memory
        for m in self.flow.models:
            if self.set_cost((m,), n) is None:
                spec, need = self.specs[m], INF
                for _, st, dyn, s, _ in self._ranked_strategies(m, n):
                    if self.flow.generates(m):  # generation buffer + one sequence of KV cache
                        dyn = max(dyn, generation_weights(spec, s)
                                  + kv_bytes_per_sequence(spec, s, self.wl))
                    need = min(need, st.static + dyn)
                raise ModelDoesNotFitError(m, spec.describe(), n, need, q)

    def run(self) -> Plan:
        t0 = time.perf_counter()
        n = self.cluster.n_devices
        self.check_each_model_fits()
        best, n_alloc, n_place = None, 0, 0
        for placement in set_partitions(self.flow.models):
            n_place += 1
            mins = [self.min_devices(p, n) for p in placement]
            if any(m is None for m in mins) or sum(mins) > n:
                continue
            # Stage-cost tables per set for every device count it can get.
            hi = [n - sum(mins) + m for m in mins]
            tables = []
            for p, lo, h in zip(placement, mins, hi):
                row = {}
                for k in range(lo, h + 1):
                    r = self.set_cost(p, k)
                    if r is not None:
                        row[k] = r[0]
                tables.append(row)
            for alloc in compositions(n, mins):
                n_alloc += 1
                try:
                    cost = d_cost([t[a] for t, a in zip(tables, alloc)])
                except KeyError:   # a size at which the set does not fit
                    continue
                if best is None or cost < best[0]:
                    best = (cost, placement, alloc)
        if best is None:
            floors = {m: self.min_devices((m,), n) for m in self.flow.models}
            raise NoFeasiblePlanError(
                f"every model fits on its own, but no placement fits all of "
                f"{list(self.flow.models)} on {n} devices together; least devices per model "
                f"alone: {floors}. Use more devices or smaller models/micro-batches.")
        return self._build(best, {"placements": n_place, "allocations": n_alloc,
                                  "seconds": time.perf_counter() - t0,
                                  "strategy_cache": len(self._ranked)})

    def _build(self, best, stats) -> Plan:
        cost, placement, alloc = best
        # Larger sets first so they start on a machine boundary (TP groups stay in a node).
        order = sorted(range(len(placement)), key=lambda i: -alloc[i])
        packed = pack_sets([alloc[i] for i in order], self.cluster.devices_per_node)
        sets, call_times, stages = [], {}, [0.0] * self.n_stages
        for i, (first, counts, nodes) in zip(order, packed):
            models = placement[i]
            st, choices, peak = self.set_cost(models, alloc[i])
            for s_i, v in enumerate(st):
                stages[s_i] = max(stages[s_i], v)
            assigns = {}
            for m in models:
                c = choices[m]
                call_times.update(c.call_times)
                assigns[m] = ModelAssignment(m, self.specs[m], c.strategy, c.generation,
                                             c.static + MemoryBreakdown(activations=c.dynamic))
            sets.append(ColocatedSet("+".join(models), models, first, alloc[i], counts, nodes,
                                     assigns, peak))
        return Plan(self.flow, self.cluster, self.wl, tuple(sets), call_times, tuple(stages),
                    cost, stats)


def automap(dataflow: Dataflow, models: ModelSpec | str | dict, workload: Workload,
            cluster: ClusterSpec, max_tp: int | None = None, max_pp: int | None = None) -> Plan:
    """HybridFlow auto-mapping: the placement, allocation and per-model layouts with the
    lowest estimated iteration time. `models` is one spec/preset name for every role or a
    dict role -> spec/preset. `max_tp` / `max_pp` bound the layouts to what the workers that
    will run the plan implement (`max_tp=1, max_pp=1`: data parallelism only)."""
    return AutoMapper(dataflow, dataflow.model_specs(models), workload, cluster, max_tp, max_pp).run()
