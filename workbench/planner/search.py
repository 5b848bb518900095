"""ReaLHF plan search: Metropolis-Hastings over execution plans (ReaLHF §3 of the reference).

Cost(p) = TimeCost(p) if MaxMem(p) fits, else an OOM-penalised TimeCost. The chain targets
P(p) ∝ exp(-β·Cost(p)); it starts from the greedy plan (each call on its own fastest
mesh/strategy), proposes a new mesh and/or strategy for one random call, accepts with
min(1, P(new)/P(old)), and keeps the best plan seen until its step budget (and, if given, a
wall-time limit) is spent; then `polish` descends from that plan to the local optimum beside
it (moves of one call, of one model's calls, of a colocated set, of two calls at once).
`search` runs several chains from different seeds (the first from the auto-mapper's plan)
and reports whether they agree: the best cost of each chain, their spread, and where each
last improved, so a result that depends on the seed says so. With a step budget and no time limit the
result depends only on the seeds, not on how fast the machine is.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from workbench.mesh import Mesh
from workbench.planner.automap import automap, fastest_keep
from workbench.planner.call_groups import runtime_refusal
from workbench.planner.errors import PlannerError
from workbench.planner.execution import DeviceRange, Evaluation, ExecutionPlan, PlanEvaluator, valid_meshes
from workbench.planner.memory import (
    generation_weights,
    inference_activations,
    kv_bytes_per_sequence,
    static_memory,
    train_activations,
)
from workbench.planner.problem import Problem
from workbench.planner.specs import Workload
from workbench.planner.strategy import strategies


class PlanSpace:
    """The options (mesh, strategy) of every call, and a memoised plan evaluator."""

    def __init__(
        self,
        problem: Problem,
        n_iterations: int = 2,
        oom_penalty: float = 10.0,
        meshes: list[DeviceRange] | None = None,
        runnable: bool = False,
    ):
        """runnable: keep to plans `deploy_calls` runs (what it does with a call away from its
        model's home: `call_groups.runtime_refusal`); the others cost infinity. The problem's
        max_tp / max_pp bound every call's layout (max_tp=1, max_pp=1 for workers without tensor
        or pipeline parallelism, backend="fsdp")."""
        self.problem = problem
        self.flow, self.specs = problem.dataflow, problem.specs
        self.wl, self.cluster = problem.workload, problem.cluster
        self.evaluator = PlanEvaluator(problem, n_iterations, oom_penalty)
        self.calls = [c.name for c in self.flow.calls]
        self.runnable = runnable
        meshes = meshes if meshes is not None else valid_meshes(self.cluster)
        max_tp, max_pp = problem.max_tp, problem.max_pp
        self.options: list[list[tuple[DeviceRange, Mesh]]] = []
        for c in self.flow.calls:
            spec = self.specs[c.model]
            opts = [
                (m, s)
                for m in meshes
                for s in strategies(spec, m.size, self.cluster.devices_per_node)
                if (max_tp is None or s.tp <= max_tp) and (max_pp is None or s.pp <= max_pp)
            ]
            if not opts:
                raise ValueError(
                    f"call {c.name!r}: no layout on meshes {[str(m) for m in meshes]} within max_tp={max_tp}, "
                    f"max_pp={max_pp}; raise the limits or offer other meshes"
                )
            self.options.append(opts)
        # Indexes for the local moves: same mesh / same (size, strategy).
        self._by_mesh: list[dict[DeviceRange, list[int]]] = []
        self._by_shape: list[dict[tuple[int, Mesh], list[int]]] = []
        for opts in self.options:
            by_mesh: dict[DeviceRange, list[int]] = {}
            by_shape: dict[tuple[int, Mesh], list[int]] = {}
            for j, (m, s) in enumerate(opts):
                by_mesh.setdefault(m, []).append(j)
                by_shape.setdefault((m.size, s), []).append(j)
            self._by_mesh.append(by_mesh)
            self._by_shape.append(by_shape)
        self._index = [{o: j for j, o in enumerate(opts)} for opts in self.options]
        self._cache: dict[tuple[int, ...], float] = {}

    @property
    def size(self) -> int:
        return math.prod(len(o) for o in self.options)

    def plan(self, choice: tuple[int, ...]) -> ExecutionPlan:
        return ExecutionPlan({c: self.options[i][j] for i, (c, j) in enumerate(zip(self.calls, choice))})

    def evaluate(self, choice: tuple[int, ...]) -> Evaluation:
        return self.evaluator.evaluate(self.plan(choice))

    def cost(self, choice: tuple[int, ...]) -> float:
        c = self._cache.get(choice)
        if c is None:
            c = math.inf if self.refusal(choice) else self.evaluate(choice).cost
            self._cache[choice] = c
        return c

    def refusal(self, choice: tuple[int, ...]) -> str | None:
        """With runnable=True, why the runtime would refuse this plan (None: it runs)."""
        return runtime_refusal(self.plan(choice), self.flow) if self.runnable else None

    def choice_of(self, plan: ExecutionPlan) -> tuple[int, ...] | None:
        """`plan` as option indices; None when a call's (mesh, strategy) is not an option here."""
        choice = tuple(self._index[i].get(plan.layouts[c], -1) for i, c in enumerate(self.calls))
        return None if -1 in choice else choice

    def runnable_start(self, choice: tuple[int, ...]) -> tuple[int, ...]:
        """`choice`, or, when the runtime would refuse it, a plan it runs: every call on the
        largest mesh, each model's calls in one layout there."""
        if self.refusal(choice) is None:
            return choice
        largest = max(m.size for opts in self.options for m, _ in opts)
        layout: dict[str, Mesh] = {}
        out = []
        for call, opts in zip(self.flow.calls, self.options):
            on_largest = [j for j, (m, _) in enumerate(opts) if m.size == largest and m.first == 0]
            wanted = layout.setdefault(call.model, opts[on_largest[0]][1])
            out.append(next((j for j in on_largest if opts[j][1] == wanted), on_largest[0]))
        return tuple(out)

    def greedy(self) -> tuple[int, ...]:
        """Each call on the option with the least standalone time that fits in memory alone
        (the ReaLHF starting point: minimum sum of call costs)."""
        q, out = self.cluster.device_memory, []
        for call, opts in zip(self.flow.calls, self.options):
            spec, trained = self.specs[call.model], self.flow.trained(call.model)
            best = None
            for j, (_mesh, s) in enumerate(opts):
                static = static_memory(spec, s, trained, self.wl.param_sharding, self.wl.frozen_keep).static
                if call.kind == "train":
                    dyn, t = train_activations(spec, s, self.wl), None
                elif call.kind == "inference":
                    dyn, t = inference_activations(spec, s, self.wl), None
                else:
                    free = q - static - generation_weights(spec, s)
                    dyn = generation_weights(spec, s) + kv_bytes_per_sequence(spec, s, self.wl)
                    t = self.evaluator.sim.generate(spec, s, max(free, 1.0), call.batch_factor)
                if t is None:
                    t = self.evaluator.sim.call_time(call, spec, s, trained=trained)
                fits = static + dyn <= q
                key = (not fits, t)
                if best is None or key < best[0]:
                    best = (key, j)
            if best is None:  # __init__ refuses a call without options
                raise AssertionError(f"call {call.name!r} has no options")
            out.append(best[1])
        return tuple(out)

    def random_plan(self, rng: random.Random) -> tuple[int, ...]:
        """A uniformly random option for every call."""
        return tuple(rng.randrange(len(o)) for o in self.options)

    def random_runnable(self, rng: random.Random, tries: int = 200) -> tuple[int, ...] | None:
        """A random plan the runtime deploys, or None: each model's calls together on one random
        option (a model's calls share their options). A uniformly random plan seldom runs (a
        trained model's calls land on meshes that overlap partly), and a chain cannot walk out
        of a refused start."""
        for _ in range(tries):
            option: dict[str, int] = {}
            choice = tuple(
                option.setdefault(call.model, rng.randrange(len(opts)))
                for call, opts in zip(self.flow.calls, self.options)
            )
            if self.refusal(choice) is None:
                return choice
        return None

    def _move_one(self, choice: tuple[int, ...], i: int, rng: random.Random) -> int:
        m, s = self.options[i][choice[i]]
        move = rng.random()
        pool = self._by_mesh[i][m] if move < 1 / 3 else self._by_shape[i][(m.size, s)] if move < 2 / 3 else None
        if pool is None or len(pool) < 2:
            return rng.randrange(len(self.options[i]))
        return rng.choice(pool)

    def neighbours(self, choice: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The plans `polish` tries around `choice`: one call to any option; every call of one
        model to one option (its calls share the options); every call on one mesh to another
        mesh of the same size, each keeping its strategy (a colocated set moved as a whole)."""
        out = []
        for i, opts in enumerate(self.options):
            out += [choice[:i] + (j,) + choice[i + 1 :] for j in range(len(opts)) if j != choice[i]]
        for model in dict.fromkeys(c.model for c in self.flow.calls):
            idx = [i for i, c in enumerate(self.flow.calls) if c.model == model]
            if len(idx) > 1 and all(self.options[i] == self.options[idx[0]] for i in idx):
                for j in range(len(self.options[idx[0]])):
                    moved = list(choice)
                    for i in idx:
                        moved[i] = j
                    out.append(tuple(moved))
        meshes = {self.options[i][j][0] for i, j in enumerate(choice)}
        targets = {m for opts in self.options for m, _ in opts}
        for m in meshes:
            on = [i for i, j in enumerate(choice) if self.options[i][j][0] == m]
            for t in targets:
                if t.size != m.size or t == m:
                    continue
                moved = list(choice)
                for i in on:
                    moved[i] = self._index[i].get((t, self.options[i][choice[i]][1]), -1)
                if -1 not in moved:
                    out.append(tuple(moved))
        return out

    def propose(self, choice: tuple[int, ...], rng: random.Random) -> tuple[int, ...]:
        """Change one random call (or, one time in four, two): to any option, or to a new
        strategy on the same mesh, or to the same strategy on another mesh of the same size.
        Each move is symmetric, so the Metropolis ratio needs no proposal correction. Two-call
        moves let calls of one level leave disjoint meshes for a shared one together."""
        out = list(choice)
        calls = rng.sample(range(len(choice)), 2 if len(choice) > 1 and rng.random() < 0.25 else 1)
        for i in calls:
            out[i] = self._move_one(choice, i, rng)
        return tuple(out)


@dataclass
class SearchResult:
    """Best plan found and how the search went."""

    plan: ExecutionPlan
    evaluation: Evaluation
    choice: tuple[int, ...]
    steps: int
    accepted: int
    seconds: float
    initial_cost: float
    history: list[tuple[int, float]] = field(default_factory=list)
    """(step, best cost) each time the best improved."""
    seed: int = 0
    convergence: Convergence | None = None
    """Set by `multi_chain` / `search`: agreement of the chains."""
    chains: list[SearchResult] = field(default_factory=list)
    """Every chain's result (multi_chain / search)."""
    chain_cost: float = 0.0
    """The best cost the chain itself reached, before `polish` (equal to the result's when the
    polish found nothing cheaper)."""
    workload: Workload | None = None
    """Set by `search`: the workload searched (with frozen_keep="auto", the keep it chose)."""


def mcmc(
    space: PlanSpace,
    *,
    max_steps: int | None = 20_000,
    time_limit: float | None = None,
    seed: int = 0,
    beta: float | None = None,
    beta_scale: float = 20.0,
    init: tuple[int, ...] | None = None,
    polish_best: bool = True,
) -> SearchResult:
    """Metropolis-Hastings from the greedy plan (or `init`) for `max_steps` proposals (and at
    most `time_limit` seconds when given; then the result depends on the machine's speed).
    Unless `beta` is given, β is beta_scale / (best cost so far): with the default 20, a plan
    5% worse than the best is accepted with probability 1/e. Rescaling when the best improves
    keeps the temperature at the scale of good plans rather than of an OOM-penalised greedy
    start. (20 was chosen on the enumerable test space: colder chains stuck in near-tie local
    optima more often.) `polish_best`: end with `polish` of the best plan (within the time
    limit; not counted in the steps or the history; `chain_cost` keeps what the chain reached)."""
    if max_steps is None and time_limit is None:
        raise ValueError("mcmc needs a budget: max_steps (deterministic) and/or time_limit")
    rng = random.Random(seed)
    t0 = time.perf_counter()
    cur = space.runnable_start(init if init is not None else space.greedy())
    cur_cost = space.cost(cur)
    fixed_beta = beta
    beta = fixed_beta if fixed_beta is not None else beta_scale / cur_cost
    best, best_cost = cur, cur_cost
    history, steps, accepted = [(0, cur_cost)], 0, 0
    while (max_steps is None or steps < max_steps) and (time_limit is None or time.perf_counter() - t0 < time_limit):
        steps += 1
        new = space.propose(cur, rng)
        new_cost = space.cost(new)
        delta = new_cost - cur_cost
        if delta <= 0 or rng.random() < math.exp(-beta * delta):
            cur, cur_cost = new, new_cost
            accepted += 1
            if cur_cost < best_cost:
                best, best_cost = cur, cur_cost
                history.append((steps, best_cost))
                if fixed_beta is None:
                    beta = beta_scale / best_cost
    chain_cost = best_cost
    if polish_best:
        best = polish(space, best, deadline=None if time_limit is None else t0 + time_limit)
    return SearchResult(
        space.plan(best),
        space.evaluate(best),
        best,
        steps,
        accepted,
        time.perf_counter() - t0,
        history[0][1],
        history,
        seed,
        chain_cost=chain_cost,
    )


def polish(
    space: PlanSpace, choice: tuple[int, ...], pair_options: int = 4, deadline: float | None = None
) -> tuple[int, ...]:
    """Steepest descent from `choice` until no neighbour is cheaper (or `time.perf_counter()`
    passes `deadline`): `PlanSpace.neighbours`, plus every pair of calls moved together, each
    to one of its `pair_options` best options alone (two calls leaving one mesh for its two
    halves: a step no single move takes without first getting worse). A chain at a finite
    temperature ends near an optimum, rarely on it; without this, chains of different seeds
    near the same optimum report different costs."""
    best, best_cost = choice, space.cost(choice)

    def cost(c: tuple[int, ...]) -> float:
        if deadline is not None and time.perf_counter() > deadline:
            raise TimeoutError
        return space.cost(c)

    try:
        while True:
            around = space.neighbours(best)
            shortlist = []
            for i, opts in enumerate(space.options):
                alone = sorted(range(len(opts)), key=functools.partial(_cost_with, cost, best, i))
                shortlist.append([j for j in alone if j != best[i]][:pair_options])
            for i, k in itertools.combinations(range(len(best)), 2):
                for a in shortlist[i]:
                    for b in shortlist[k]:
                        moved = list(best)
                        moved[i], moved[k] = a, b
                        around.append(tuple(moved))
            around += _level_splits(space, best, cost)
            nearest = min(around, key=cost, default=best)
            if cost(nearest) >= best_cost:
                return best
            best, best_cost = nearest, cost(nearest)
    except TimeoutError:
        return best


def _cost_with(cost: Callable[[tuple[int, ...]], float], choice: tuple[int, ...], i: int, j: int) -> float:
    """The cost of `choice` with call i moved to option j (a sort key, bound per call)."""
    return cost(choice[:i] + (j,) + choice[i + 1 :])


def _level_splits(space: PlanSpace, choice: tuple[int, ...], cost) -> list[tuple[int, ...]]:
    """Calls of one dependency level sharing a mesh spread over its equal parts (2, or one part
    per call), each on its cheapest option there with the others fixed: the colocated ->
    split step that takes many calls at once, so neither a chain nor the smaller moves find it."""
    level = space.flow.levels()
    valid = {m for opts in space.options for m, _ in opts}
    groups: dict[tuple, list[int]] = {}
    for i, j in enumerate(choice):
        groups.setdefault((level[space.calls[i]], space.options[i][j][0]), []).append(i)
    out = []
    for (_, mesh_), calls in groups.items():
        for n in sorted({2, len(calls)}):
            if len(calls) < 2 or mesh_.size % n:
                continue
            parts = [DeviceRange(mesh_.first + p * mesh_.size // n, mesh_.size // n) for p in range(n)]
            if not all(p in valid for p in parts):
                continue
            moved = list(choice)
            for k, i in enumerate(calls):
                on_part = [j for j, (m, _) in enumerate(space.options[i]) if m == parts[k % n]]
                if not on_part:
                    break
                moved[i] = min(on_part, key=functools.partial(_cost_with, cost, choice, i))
            else:
                out.append(tuple(moved))
    return out


@dataclass
class Convergence:
    """How far several chains agree on the best plan."""

    seeds: tuple[int, ...]
    best_costs: tuple[float, ...]
    """Best cost reached by each chain."""
    last_improvement: tuple[float, ...]
    """Fraction of each chain's steps after which it found nothing better (near 1: still
    improving at the end, the budget is too small)."""
    tolerance: float
    """Relative spread of the best costs accepted as agreement."""

    @property
    def spread(self) -> float:
        """(worst - best) / best over the chains' best costs."""
        lo = min(self.best_costs)
        return (max(self.best_costs) - lo) / lo

    @property
    def agree(self) -> bool:
        return self.spread <= self.tolerance

    @property
    def same_plan(self) -> bool:
        return len(set(self.best_costs)) == 1

    def describe(self) -> str:
        costs = ", ".join(f"{c:.2f}" for c in self.best_costs)
        late = max(self.last_improvement)
        verdict = "agree" if self.agree else "DISAGREE (raise max_steps or chains)"
        return (
            f"{len(self.seeds)} chains {verdict}: best costs [{costs}], spread "
            f"{self.spread:.1%} (tolerance {self.tolerance:.1%}); latest improvement at "
            f"{late:.0%} of a chain's steps"
        )


def multi_chain(
    space: PlanSpace,
    seeds: tuple[int, ...] = (0, 1, 2, 3),
    *,
    max_steps: int | None = 20_000,
    time_limit: float | None = None,
    tolerance: float = 0.01,
    first_start: tuple[int, ...] | None = None,
    **kw,
) -> SearchResult:
    """One chain per seed; the best chain's result with a `convergence` report. The first
    chain starts from `first_start` (`search`: the auto-mapper's plan) or the greedy plan
    (ReaLHF), the others from a random plan drawn from their seed (a random runnable one when
    the space keeps to what runs), so that agreement means the chains found the same optimum
    from different places."""
    runs = []
    for i, s in enumerate(seeds):
        rng = random.Random(f"start {s}")
        start = (
            first_start
            if i == 0
            else (space.random_runnable(rng) if space.runnable else None) or space.random_plan(rng)
        )
        runs.append(mcmc(space, max_steps=max_steps, time_limit=time_limit, seed=s, init=start, **kw))
    best = min(runs, key=lambda r: (r.evaluation.cost, r.seed))
    best.convergence = Convergence(
        tuple(seeds),
        tuple(r.evaluation.cost for r in runs),
        tuple(r.history[-1][0] / max(1, r.steps) for r in runs),
        tolerance,
    )
    best.chains = runs
    return best


def exhaustive(space: PlanSpace, limit: int = 200_000) -> tuple[tuple[int, ...], float]:
    """The optimum by enumeration (only for small spaces; raises above `limit` plans)."""
    if space.size > limit:
        raise ValueError(f"plan space has {space.size} plans, above the limit {limit}")
    best = None
    for choice in itertools.product(*(range(len(o)) for o in space.options)):
        c = space.cost(choice)
        if best is None or c < best[1]:
            best = (choice, c)
    if best is None:  # a product of non-empty option lists has at least one plan
        raise AssertionError("exhaustive: empty plan space")
    return best


def search(
    problem: Problem,
    *,
    max_steps: int | None = 20_000,
    time_limit: float | None = None,
    seeds: tuple[int, ...] = (0, 1, 2, 3),
    n_iterations: int = 2,
    tolerance: float = 0.01,
    runnable: bool = False,
) -> SearchResult:
    """ReaLHF search with the defaults: valid meshes, a 2-iteration unrolled graph, one chain
    per seed for `max_steps` proposals each. `result.convergence` says whether the chains'
    best costs agree within `tolerance`. runnable and the problem's max_tp, max_pp: keep to plans
    this runtime deploys (`deploy_calls`), with layouts the workers run (PlanSpace). The first
    chain starts from the auto-mapper's plan (a good basin to start in: `automap_start`).
    `problem.workload.frozen_keep` "auto": a search per keep, each with the whole budget (three
    times the steps and time), the cheapest result (`automap.fastest_keep`); `result.workload`
    names the keep."""
    if problem.workload.frozen_keep == "auto":
        return fastest_keep(
            lambda p: search(
                p,
                max_steps=max_steps,
                time_limit=time_limit,
                seeds=seeds,
                n_iterations=n_iterations,
                tolerance=tolerance,
                runnable=runnable,
            ),
            problem,
            lambda result: result.evaluation.cost,  # the search's own objective: a plan that does not fit pays
        )
    space = PlanSpace(problem, n_iterations, runnable=runnable)
    result = multi_chain(
        space, seeds, max_steps=max_steps, time_limit=time_limit, tolerance=tolerance, first_start=automap_start(space)
    )
    result.workload = problem.workload
    return result


def automap_start(space: PlanSpace) -> tuple[int, ...] | None:
    """The auto-mapper's plan for `space`'s problem (HybridFlow Alg. 1, a fraction of a second)
    in `space`; None when it finds none or its layouts are not options of `space`."""
    try:
        plan = automap(space.problem)
    except PlannerError:
        return None
    return space.choice_of(plan.to_execution_plan())
