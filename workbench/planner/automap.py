"""HybridFlow auto device mapping (paper §6, Algorithm 1; auto_parallel from Appendix C, Alg. 2).

  for each placement (set partition of the models):
      A_min = least devices per colocated set that fit the set's memory
      for each allocation (integer composition of N with parts >= A_min):
          auto_parallel every model on its set's devices (cached per (model, devices))
          d_cost = sum over levels of (max over sets of (sum of the set's calls in the level))
  keep the cheapest.

Auto-parallel picks the fastest (p, t, d) that fits; for the actor, the training layout first,
then the generation layout (p_g | p, t_g | t) with the fastest generation in the memory left.
The levels are the dataflow's dependency levels (`Dataflow.levels`), the paper's "stages".

Asynchronous RL (`automap_async`, `AutoMapper.run_async`): generation moves to a rollout set of
its own (`Dataflow.with_rollout`) and each allocation is scored by the asynchronous iteration
model (`asynchronous`: the slower of generation and the trainer's sets, plus the weight push)
instead of d_cost; `automap(..., max_staleness=s)` returns it when it beats every synchronous plan.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from workbench.mesh import Mesh
from workbench.planner.asynchronous import Sharing, steady_iteration
from workbench.planner.errors import ModelDoesNotFitError, NoFeasiblePlanError, PlannerError
from workbench.planner.memory import (
    MemoryBreakdown,
    Transition,
    generation_memory,
    inference_activations,
    kv_bytes_per_sequence,
    static_memory,
    train_activations,
    transition,
)
from workbench.planner.placement import ColocatedSet, ModelAssignment, pack_sets, span
from workbench.planner.plan import AsyncPlan, Plan
from workbench.planner.problem import Problem
from workbench.planner.schedule import concurrent_time, shared_cores
from workbench.planner.simulator import INF, Simulator
from workbench.planner.specs import FROZEN_KEEPS
from workbench.planner.strategy import generation_strategies, strategies

P = TypeVar("P")


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
            yield part[:i] + ((first,) + part[i],) + part[i + 1 :]


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


def d_cost(level_costs: Sequence[Sequence[float]]) -> float:
    """Iteration cost from per-set level costs (HybridFlow Alg. 1): level_costs[j][s] is the
    sum of set j's calls in level s; sets run in parallel (max), levels in sequence (sum)."""
    return sum(max(col) for col in zip(*level_costs))


@dataclass(frozen=True)
class ModelChoice:
    """One model's layout inside a colocated set, with its call times and memory."""

    strategy: Mesh
    generation: Mesh | None
    call_times: dict[str, float]
    static: MemoryBreakdown
    dynamic: MemoryBreakdown
    """Peak per-device dynamic bytes over the model's calls, by kind."""
    transition: Transition | None = None
    """The actor's training -> generation switch (Table 2 bytes and memory)."""

    @property
    def time(self) -> float:
        return sum(self.call_times.values())


@dataclass(frozen=True)
class _Layout:
    """A candidate layout of one model on n devices, before its colocated set is known."""

    strategy: Mesh
    generation: Mesh | None
    static: MemoryBreakdown
    activations: float
    """Peak activations of its train / inference calls."""
    times: dict[str, float]
    """Seconds of the calls that do not generate."""
    bound: float
    """Lower bound of the layout's total time (generation with its whole batch at once)."""


class AutoMapper:
    """Holds the caches of one auto-mapping run; `run()` returns the best Plan."""

    def __init__(self, problem: Problem, allocation: str | None = None):
        """`allocation` overrides the cluster's default device split ("aligned" or "free")."""
        self.problem = problem
        self.flow, self.specs = problem.dataflow, problem.specs
        self.wl, self.cluster = problem.workload, problem.cluster
        self.max_tp, self.max_pp = problem.max_tp, problem.max_pp
        self.allocation = allocation or self.cluster.allocation
        if self.allocation not in ("aligned", "free"):
            raise ValueError(
                f"allocation={self.allocation!r}: use 'aligned' (whole machines or "
                f"power-of-two slices of one) or 'free' (any device count)"
            )
        self.sim = Simulator(self.cluster, self.wl)
        self.level = self.flow.levels()
        self.n_levels = self.flow.n_levels
        trains = [self.level[c.name] for c in self.flow.calls if c.kind == "train"]
        self._driver_level = min(trains) if trains and self.flow.driver_inputs() else None
        self._layouts: dict[tuple[str, int], list[_Layout]] = {}
        self._sets: dict[tuple[tuple[str, ...], int], tuple | None] = {}

    # --- layouts of one model (Alg. 2's candidates) -------------------------------------------
    def layouts(self, model: str, n: int) -> list[_Layout]:
        """Candidate layouts of `model` on n devices, cached per (model, device count) as in
        the paper. The actor's are (training, generation) pairs, so both are chosen together
        with the transition between them; other models keep only layouts no other one beats
        in static memory, activations and time at once."""
        key = (model, n)
        if key in self._layouts:
            return self._layouts[key]
        spec, trained = self.specs[model], self.flow.trained(model)
        calls = [c for c in self.flow.calls_of(model) if c.kind != "generate"]
        gen_calls = [c for c in self.flow.calls_of(model) if c.kind == "generate"]
        out = []
        for s in strategies(spec, n, self.cluster.devices_per_node):
            if s.tp > (self.max_tp or s.tp) or s.pp > (self.max_pp or s.pp):
                continue
            times = {c.name: self.sim.call_time(c, spec, s, trained=trained) for c in calls}
            act = max(
                [
                    train_activations(spec, s, self.wl)
                    if c.kind == "train"
                    else inference_activations(spec, s, self.wl)
                    for c in calls
                ],
                default=0.0,
            )
            static = static_memory(spec, s, trained, self.wl.param_sharding, self.wl.frozen_keep)
            if not gen_calls:
                out.append(_Layout(s, None, static, act, times, sum(times.values())))
                continue
            # A model that generates and does not train (a rollout group of its own) keeps one
            # layout for both and never switches; the actor switches to a generation layout.
            for g in generation_strategies(s) if trained else [s]:
                if g.tp > (self.max_tp or g.tp) or g.pp > (self.max_pp or g.pp):
                    continue
                bound = (
                    sum(times.values())
                    + (self.sim.reshard_time(spec, s, g) if trained else 0.0)
                    + sum(self.sim.generate(spec, g, batch_factor=c.batch_factor) for c in gen_calls)
                )
                out.append(_Layout(s, g, static, act, times, bound))
        if not gen_calls:
            out = _pareto(out)
        out.sort(key=lambda o: (o.bound, o.strategy, o.generation or o.strategy))
        self._layouts[key] = out
        return out

    def _generating_choice(self, model: str, layout: _Layout, free: float):
        """(ModelChoice, dynamic bytes) of a generating layout when `free` bytes per device
        are left after the set's static memory; None if its generation does not fit."""
        spec, s, g = self.specs[model], layout.strategy, layout.generation
        times, dyn, gm = dict(layout.times), MemoryBreakdown(activations=layout.activations), None
        first = trained = self.flow.trained(model)  # an untrained generator has no switch
        for c in self.flow.calls_of(model):
            if c.kind != "generate":
                continue
            if g is None:  # layouts() gives every layout of a generating model its generation
                raise AssertionError(f"{model}: layout {s.short()} has no generation layout")
            gm = generation_memory(spec, s, g, self.wl, layout.static.params, free, self.wl.transition, c.batch_factor)
            if gm is None:
                return None
            batch = math.ceil(self.wl.sequences * c.batch_factor / g.dp)
            times[c.name] = self.sim.generate_waves(spec, g, batch, gm.concurrency) + (
                self.sim.reshard_time(spec, s, g) if first else 0.0
            )
            first = False
            if gm.dynamic > dyn.total:
                dyn = MemoryBreakdown(
                    kv_cache=gm.dynamic - gm.extra_params if gm.dynamic > gm.peak_extra else 0.0,
                    extra_params=gm.extra_params if gm.dynamic > gm.peak_extra else gm.peak_extra,
                )
        if not trained:
            return ModelChoice(s, None, times, layout.static, dyn)
        return ModelChoice(s, g, times, layout.static, dyn, gm.transition if gm else None)

    # --- colocated sets ------------------------------------------------------------------------
    def set_cost(self, models: tuple[str, ...], n: int):
        """(level costs, choices, peak memory) of a colocated set on n devices, or None when
        no combination of layouts fits. The layouts are searched jointly under the shared
        budget: the set fits iff the static memory of all its models plus the largest call's
        dynamic memory fits; the fastest such combination (sum of the set's call times)
        wins. The generating model (the actor) is chosen last, its KV cache taking what the
        others' static memory leaves."""
        key = (models, n)
        if key in self._sets:
            return self._sets[key]
        q = self.cluster.device_memory
        gens = [m for m in models if self.flow.generates(m)]
        if len(gens) > 1:
            raise PlannerError(
                f"colocated set {'+'.join(models)}: more than one generating "
                f"model ({gens}); the planner handles one per set"
            )
        plain = [m for m in models if m not in gens]
        best = None  # (total time, {model: ModelChoice}, peak)
        for combo in itertools.product(*(self.layouts(m, n) for m in plain)):
            s_o = sum(o.static.total for o in combo)
            d_o = max((o.activations for o in combo), default=0.0)
            t_o = sum(o.bound for o in combo)
            if s_o + d_o > q or (best is not None and t_o >= best[0]):
                continue
            choices = {
                m: ModelChoice(o.strategy, None, dict(o.times), o.static, MemoryBreakdown(activations=o.activations))
                for m, o in zip(plain, combo)
            }
            if not gens:
                best = (t_o, choices, s_o + d_o)
                continue
            for layout in self.layouts(gens[0], n):
                if best is not None and t_o + layout.bound >= best[0]:
                    break
                total_static = s_o + layout.static.total
                if total_static + max(d_o, layout.activations) > q:
                    continue
                choice = self._generating_choice(gens[0], layout, q - total_static)
                if choice is None:
                    continue
                total = t_o + choice.time
                if best is None or total < best[0]:
                    peak = total_static + max(d_o, choice.dynamic.total)
                    best = (total, {**choices, gens[0]: choice}, peak)
        result = None
        if best is not None:
            choices = {m: best[1][m] for m in models}
            levels = [0.0] * self.n_levels
            for c in choices.values():
                for call, t in c.call_times.items():
                    levels[self.level[call]] += t
            result = (tuple(levels), choices, best[2])
        self._sets[key] = result
        return result

    def sizes(self, n_max: int) -> list[int]:
        """Device counts a colocated set may get: ReaLHF meshes when aligned, else any."""
        if self.allocation == "aligned":
            return [k for k in self.cluster.mesh_sizes() if k <= n_max]
        return list(range(1, n_max + 1))

    def min_devices(self, models: tuple[str, ...], n_max: int) -> int | None:
        """A_min: the least device count on which the set fits (None if none up to n_max)."""
        for n in self.sizes(n_max):
            if self.set_cost(models, n) is not None:
                return n
        return None

    # --- Algorithm 1 ---------------------------------------------------------------------------
    def check_each_model_fits(self) -> None:
        n, q = self.cluster.n_devices, self.cluster.device_memory
        for m in self.flow.models:
            if self.min_devices((m,), n) is None:
                spec, need = self.specs[m], INF
                for o in self.layouts(m, n):
                    dyn = o.activations
                    if o.generation is not None:  # the switch's peak and one sequence of KV
                        t = transition(spec, o.strategy, o.generation, self.wl.transition)
                        kv = kv_bytes_per_sequence(spec, o.generation, self.wl)
                        dyn = max(dyn, max(t.peak_params, t.resident_params + kv) - o.static.params)
                    need = min(need, o.static.total + dyn)
                raise ModelDoesNotFitError(m, spec.describe(), n, need, q)

    def run(self, placements: Sequence[tuple[tuple[str, ...], ...]] | None = None) -> Plan:
        """The best plan over every placement, or over `placements` only (e.g. the colocate,
        split and standalone baselines). A set may leave devices of its allocation idle
        when fewer run it faster, so a larger cluster never gives a slower plan."""
        t0 = time.perf_counter()
        n = self.cluster.n_devices
        self.check_each_model_fits()
        best, n_alloc, n_place = None, 0, 0
        for placement in placements if placements is not None else set_partitions(self.flow.models):
            n_place += 1
            least = [self.min_devices(p, n) for p in placement]
            mins = [m for m in least if m is not None]
            if len(mins) < len(least) or sum(mins) > n:  # a set that fits nowhere, or too many devices
                continue
            hi = [n - sum(mins) + m for m in mins]
            tables = [self._table(p, lo, h) for p, lo, h in zip(placement, mins, hi)]
            found, count = self._best_allocation(
                tables, n, lambda rows, placement=placement: sum(self.level_times(rows, placement))
            )
            n_alloc += count
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], placement, found[1])
        if best is None:
            floors = {m: self.min_devices((m,), n) for m in self.flow.models}
            raise NoFeasiblePlanError(
                f"every model fits on its own, but no placement fits all of "
                f"{list(self.flow.models)} on {n} devices together; least devices per model "
                f"alone: {floors}. Use more devices or smaller models/micro-batches."
            )
        return self._build(
            best,
            {
                "placements": n_place,
                "allocations": n_alloc,
                "seconds": time.perf_counter() - t0,
                "allocation_policy": self.allocation,
                "strategy_cache": len(self._layouts),
            },
        )

    def _table(self, models: tuple[str, ...], lo: int, hi: int) -> dict[int, tuple]:
        """{device count: (level costs, devices used)} of a set. Free allocation keeps the best
        of every count up to it (a set may leave devices idle); aligned allocation lists the
        mesh sizes it fits on, and idle devices stay outside every set."""
        row, best = {}, None
        for k in self.sizes(hi):
            if k < lo:
                continue
            r = self.set_cost(models, k)
            if r is not None and (self.allocation == "aligned" or best is None or sum(r[0]) < sum(best[0])):
                best = (r[0], k)
            if self.allocation == "aligned":
                if r is not None:
                    row[k] = (r[0], k)
            elif best is not None:
                row[k] = best
        return row

    def _best_allocation(self, tables: list[dict], n: int, cost_of=None):
        """((cost, devices used per set), allocations tried) with the lowest cost: d_cost of the
        sets' level costs, or `cost_of(rows)` of their (level costs, devices used) rows."""
        score = cost_of or (lambda rows: d_cost([r[0] for r in rows]))
        best, count = None, 0
        if self.allocation == "free":
            mins = [min(t) for t in tables]
            for alloc in compositions(n, mins):
                count += 1
                try:
                    rows = [t[a] for t, a in zip(tables, alloc)]
                except KeyError:
                    continue
                cost = score(rows)
                if best is None or cost < best[0]:
                    best = (cost, tuple(r[1] for r in rows))
            return best, count
        u = self.cluster.devices_per_node
        for alloc in itertools.product(*(sorted(t) for t in tables)):
            if sum(alloc) > n:
                continue
            count += 1
            if pack_aligned(list(alloc), u, self.cluster.n_nodes) is None:
                continue  # the cost may need the sets' places (shared cores, a custom cost)
            cost = score([t[a] for t, a in zip(tables, alloc)])
            if best is None or cost < best[0]:
                best = (cost, alloc)
        return best, count

    def level_times(self, rows: Sequence[tuple], placement: Sequence[tuple[str, ...]]) -> tuple[float, ...]:
        """Seconds of each dependency level for the sets of `placement` and their (level costs,
        devices used) rows: HybridFlow's d_cost terms (the slowest set of the level), priced as
        TimeCost prices the same plan over one iteration (tests/planner/test_automap_agreement.py):

        - on devices that time-share cores (`ClusterSpec.cores_per_node`) the level's sets slow
          each other by TimeCost's rule (`schedule.concurrent_time`); the driver's dispatch of
          each call (`call_overhead`) holds no device and is not slowed;
        - the driver's step (`Simulator.driver_step_time`) runs before the training calls.

        Differences by design: levels are barriers here (TimeCost lets a set run into the next
        level while another finishes, so it is never slower on devices of their own); a call's
        dispatch is charged in series with the call (TimeCost overlaps it with the call running
        before it on the same devices: up to `call_overhead` per call less); data moved between
        sets is left out (it holds no device; well under a millisecond per call)."""
        shared = shared_cores(self.cluster)
        if shared is None:
            times = [max(col) for col in zip(*(r[0] for r in rows))]
        else:
            order, packed = self._packing([r[1] for r in rows])
            devices = {i: (first, first + rows[i][1]) for i, (first, _, _) in zip(order, packed)}
            times = []
            for level in range(self.n_levels):
                dispatch = [self.cluster.call_overhead * self._calls_in_level(models, level) for models in placement]
                works = [
                    (r[0][level] - d, devices[i]) for i, (r, d) in enumerate(zip(rows, dispatch)) if r[0][level] > 0
                ]
                times.append(concurrent_time(works, shared) + max(dispatch, default=0.0))
        if self._driver_level is not None:  # the driver's step runs before the training calls
            times[self._driver_level] += self.sim.driver_step_time(self.flow)
        return tuple(times)

    def _calls_in_level(self, models: tuple[str, ...], level: int) -> int:
        return sum(c.model in models and self.level[c.name] == level for c in self.flow.calls)

    def _packing(self, alloc: Sequence[int]) -> tuple[list[int], list[tuple]]:
        """Set indices in packing order and their (first device, per-node counts, nodes)."""
        u = self.cluster.devices_per_node
        if self.allocation == "aligned":
            firsts = pack_aligned(list(alloc), u, self.cluster.n_nodes)
            assert firsts is not None  # allocations that do not pack were never chosen
            return list(range(len(alloc))), [span(f, k, u) for f, k in zip(firsts, alloc)]
        # Larger sets first so they start on a machine boundary (TP groups stay in a node).
        order = sorted(range(len(alloc)), key=lambda i: -alloc[i])
        return order, pack_sets([alloc[i] for i in order], u)

    def _build(self, best, stats) -> Plan:
        cost, placement, alloc = best
        order, packed = self._packing(alloc)
        sets, call_times = [], {}
        levels = self.level_times([(self.set_cost(models, k)[0], k) for models, k in zip(placement, alloc)], placement)
        for i, (first, counts, nodes) in zip(order, packed):
            models = placement[i]
            _, choices, peak = self.set_cost(models, alloc[i])
            assigns = {}
            for m in models:
                c = choices[m]
                call_times.update(c.call_times)
                assigns[m] = ModelAssignment(
                    m, self.specs[m], c.strategy, c.generation, c.static + c.dynamic, c.transition
                )
            sets.append(ColocatedSet("+".join(models), models, first, alloc[i], counts, nodes, assigns, peak))
        sets.sort(key=lambda s: s.first_device)
        stats["idle_devices"] = self.cluster.n_devices - sum(alloc)
        return Plan(self.flow, self.cluster, self.wl, tuple(sets), call_times, tuple(levels), cost, stats)

    # --- asynchronous RL: a rollout group of its own, generation overlapping training ----------
    def run_async(
        self,
        max_staleness: int = 1,
        placements: Sequence[tuple[tuple[str, ...], ...]] | None = None,
        *,
        source: str = "actor",
        rollout: str = "rollout",
    ) -> AsyncPlan:
        """The best split plan run asynchronously: `rollout` (the generate calls of a
        `Dataflow.with_rollout` dataflow) alone on a pool of its own, the other models placed on
        the rest by `placements` (set partitions of them; default: every one), each allocation
        scored by the asynchronous iteration model (`asynchronous.steady_iteration`): the
        rollout set's generation G, the trainer sets' d_cost T and the push W of `source`'s
        weights, max(G, T) + W (G + T + W at max_staleness 0).

        Priced as the synchronous plans are: T by `level_times` (the driver's step, sets slowing
        each other on shared cores), G as the rollout set running alone, and on one machine whose
        devices time-share fewer cores the two sides slow each other while they overlap
        (`asynchronous.Sharing`, the model `bench/async_rl.py` checks)."""
        t0 = time.perf_counter()
        if rollout not in self.flow.models or self.flow.trained(rollout) or not self.flow.generates(rollout):
            raise PlannerError(
                f"run_async: the dataflow needs a rollout role {rollout!r} that generates and does not "
                f"train (Dataflow.with_rollout()); roles: {list(self.flow.models)}"
            )
        n = self.cluster.n_devices
        if n < 2:
            raise PlannerError(f"run_async: a rollout set of its own needs >= 2 devices; the cluster has {n}")
        self.check_each_model_fits()
        others = tuple(m for m in self.flow.models if m != rollout)
        best, n_alloc, n_place = None, 0, 0

        def pieces(placement, rows) -> tuple[float, float, float]:
            used = [r[1] for r in rows]
            gen = concurrent_time([(sum(rows[-1][0]), (0, used[-1]))], shared_cores(self.cluster))
            trainer = sum(self.level_times(rows[:-1], placement[:-1]))
            home = next(i for i, p in enumerate(placement) if source in p)
            at = dict(zip(*self._packing(used)))
            crosses = len(set(at[home][2]) | set(at[len(placement) - 1][2])) > 1
            src = self.set_cost(placement[home], used[home])[1][source].strategy
            dst = self.set_cost(placement[-1], used[-1])[1][rollout].strategy
            return gen, trainer, self.sim.rollout_push_time(self.specs[source], src, dst, crosses, source)

        for part in placements if placements is not None else set_partitions(others):
            placement = tuple(part) + ((rollout,),)
            if sorted(m for p in placement for m in p) != sorted(self.flow.models):
                raise PlannerError(f"run_async: placement {part} does not place each of {list(others)} once")
            n_place += 1
            hi = n - len(placement) + 1
            mins = [self.min_devices(p, hi) for p in placement]
            if any(lo is None for lo in mins):
                continue
            tables = [self._table(p, lo, hi) for p, lo in zip(placement, mins) if lo is not None]

            def score(rows, placement=placement) -> float:
                sharing = self._sides_sharing([r[1] for r in rows])
                return steady_iteration(*pieces(placement, rows), max_staleness, sharing=sharing)

            found, count = self._best_allocation(tables, n, score)
            n_alloc += count
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], placement, found[1])
        if best is None:
            raise NoFeasiblePlanError(
                f"no placement of {list(others)} beside a rollout set of its own fits on {n} devices"
            )
        stats = {"placements": n_place, "allocations": n_alloc, "allocation_policy": self.allocation}
        plan = self._build(best, {**stats, "seconds": time.perf_counter() - t0})
        rows = [self._table(p, k, k)[k] for p, k in zip(best[1], best[2])]
        gen, trainer, push = pieces(best[1], rows)
        fields = {f.name: getattr(plan, f.name) for f in dataclasses.fields(Plan)}
        return AsyncPlan(
            **fields,
            max_staleness=max_staleness,
            generation_time=gen,
            trainer_time=trainer,
            push_time=push,
            rollout=rollout,
            source=source,
            sharing=self._sides_sharing(best[2]),
        )

    def _sides_sharing(self, used: Sequence[int]) -> Sharing | None:
        """How an async plan's trainer sets and rollout set (the last of `used` devices) share
        cores while both run: on one machine with fewer cores than devices, else not at all
        (sets on other machines do not share theirs)."""
        shared = shared_cores(self.cluster)
        if shared is None or self.cluster.n_nodes > 1:
            return None
        return Sharing(shared[1], sum(used[:-1]), used[-1])


def _pareto(layouts: list[_Layout]) -> list[_Layout]:
    """Layouts not beaten by another in static memory, activations and time together."""
    keep: list[_Layout] = []
    for o in sorted(layouts, key=lambda o: (o.bound, o.static.total, o.activations)):
        if not any(k.static.total <= o.static.total and k.activations <= o.activations for k in keep):
            keep.append(o)
    return keep


def pack_aligned(sizes: list[int], devices_per_node: int, n_nodes: int) -> list[int] | None:
    """First device of each set on ReaLHF meshes: sets of whole machines on consecutive
    machines, smaller sets at offsets that are multiples of their size inside one machine
    (largest first). None if they do not fit."""
    u = devices_per_node
    free = [u] * n_nodes  # free devices per machine (filled from its start)
    used = [[False] * u for _ in range(n_nodes)]
    firsts = [-1] * len(sizes)  # each set's first device: every one is written below or None returned
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        k = sizes[i]
        if k >= u:
            whole = k // u
            start = next(
                (j for j in range(n_nodes - whole + 1) if all(free[x] == u for x in range(j, j + whole))), None
            )
            if start is None:
                return None
            for x in range(start, start + whole):
                free[x], used[x] = 0, [True] * u
            firsts[i] = start * u
            continue
        spot = next(((j, o) for j in range(n_nodes) for o in range(0, u, k) if not any(used[j][o : o + k])), None)
        if spot is None:
            return None
        j, o = spot
        used[j][o : o + k] = [True] * k
        free[j] -= k
        firsts[i] = j * u + o
    return firsts


def automap(
    problem: Problem,
    allocation: str | None = None,
    placements: Sequence[tuple[tuple[str, ...], ...]] | None = None,
    max_staleness: int | None = None,
) -> Plan:
    """HybridFlow auto-mapping: the placement, allocation and per-model layouts with the
    lowest estimated iteration time for `problem` (its `max_tp` / `max_pp` bound the layouts to
    what the workers that will run the plan implement). `allocation` overrides the cluster's
    default device split ("aligned" ReaLHF meshes or "free"); `placements` restricts the search
    to the given set partitions. `max_staleness`: also plan asynchronous split plans run with
    that bound (`automap_async`) and return whichever is faster, an `AsyncPlan` when it wins
    (None: synchronous plans only). `problem.workload.frozen_keep` "auto": the fastest of the
    plans for each keep (`fastest_keep`)."""
    if problem.workload.frozen_keep == "auto":
        return fastest_keep(
            lambda p: automap(p, allocation, placements, max_staleness),
            problem,
            lambda plan: plan.iteration_time,
        )
    plan = AutoMapper(problem, allocation).run(placements)
    if max_staleness is None:
        return plan
    try:
        split = automap_async(problem, max_staleness, allocation)
    except PlannerError:  # no split fits (e.g. one device): the synchronous plan stands
        return plan
    return split if split.iteration_time < plan.iteration_time else plan


def fastest_keep(plan_with: Callable[[Problem], P], problem: Problem, cost: Callable[[P], float]) -> P:
    """`plan_with` the problem under each way of keeping frozen models (`FROZEN_KEEPS`); the
    cheapest plan that fits by `cost` (a tie keeps the earlier keep: whole before sharded
    before host). Sharding frees device memory for other models and longer KV caches, host
    memory frees all of it, both at the price of gathers (and copies) in every forward; where no
    keep fits, the refusal for "whole" is raised."""
    found: list[tuple[float, int, P]] = []
    refusals: list[PlannerError] = []
    for order, keep in enumerate(FROZEN_KEEPS):
        try:
            plan = plan_with(problem.with_workload(dataclasses.replace(problem.workload, frozen_keep=keep)))
        except PlannerError as refused:
            refusals.append(refused)
            continue
        found.append((cost(plan), order, plan))
    if not found:
        raise refusals[0]
    return min(found, key=lambda f: f[:2])[2]


def automap_async(
    problem: Problem,
    max_staleness: int = 1,
    allocation: str | None = None,
    placements: Sequence[tuple[tuple[str, ...], ...]] | None = None,
    rollout: str = "rollout",
) -> AsyncPlan:
    """The best asynchronous split plan (`AutoMapper.run_async`): generation on a rollout group
    of its own (a frozen copy of the generating model, on devices no other model uses), the
    other models placed by `placements` (default: every set partition) on the rest, scored by
    the asynchronous iteration model with `max_staleness` (0: the synchronous split run)."""
    if problem.workload.frozen_keep == "auto":
        return fastest_keep(
            lambda p: automap_async(p, max_staleness, allocation, placements, rollout),
            problem,
            lambda plan: plan.iteration_time,
        )
    dataflow = problem.dataflow
    source = next((m for m in dataflow.models if dataflow.generates(m)), None)
    if source is None:
        raise PlannerError(f"dataflow {dataflow.name!r} has no generate call to move to a rollout group")
    specs = problem.specs
    split = dataclasses.replace(
        problem, dataflow=dataflow.with_rollout(rollout), models={**specs, rollout: specs[source]}
    )
    return AutoMapper(split, allocation).run_async(max_staleness, placements, source=source, rollout=rollout)
