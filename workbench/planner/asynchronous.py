"""The iteration model of an asynchronous plan (algorithms.asynchronous): generation on a rollout
pool of its own overlapping the trainer's work on another pool.

The runtime's order, which the model follows call for call: before the first iteration the
rollout takes the current weights (a push); it then generates batches 0..s (s = max_staleness)
one after another. The trainer trains on batch k as soon as it has arrived, then pushes the new
weights; the push is one broadcast both pools take part in, and on the rollout it is queued
behind the generations already launched (batch k+s), so it waits for whichever side is later and
blocks both. Batch k+s+1 is launched after it. Hence, with G the generation of one batch on the
rollout pool, T the trainer's side (old log-probs, reference, values, rewards, updates: every
call but generation, in turn where calls share devices) and W the push:

    s = 0 (the synchronous split run):  G + T + W per iteration
    s >= 1, steady state:                max(G, T) + W
    N iterations (s >= 1, N >= 2):       2W + max(G + T, (s+1)·G) + (N-2)·(max(G, T) + W) + T

the last being the time until the N-th update ends, the pipeline's fill included (the first
generation is not overlapped, and with s >= 2 the first push waits for s+1 generations). A
larger s does not shorten the steady state: it absorbs variation, which this deterministic
model does not have.

When the two pools time-share one machine's cores (a CPU machine: `cores`, as a calibrated
cluster's `cores_per_node`), the sides slow each other while both run: with n_A trainer and n_B
rollout devices on C cores a side alone runs at min(1, C/n) of a device's speed and both at
min(1, C/(n_A+n_B)) (processor sharing, as `schedule.time_cost` shares them). Seconds given here
are each side's time running alone.

Pure functions of seconds, named by where the seconds come from: `SOURCES` ("cost model": the
simulator's call times, `AsyncPlan` and `async_compare`; "measured call times": a run's profile,
`from_measured`, as `bench/async_rl.py` puts the model beside a measurement).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from workbench.planner.schedule import TaskGraph, time_cost

COST_MODEL = "cost model"
MEASURED = "measured call times"
SOURCES = (COST_MODEL, MEASURED, "seconds given")


@dataclass(frozen=True)
class Sharing:
    """The two pools on one machine whose `cores` their devices time-share."""

    cores: float
    trainer_devices: int = 1
    rollout_devices: int = 1

    def __post_init__(self) -> None:
        if self.cores <= 0 or self.trainer_devices < 1 or self.rollout_devices < 1:
            raise ValueError(f"{self}: cores must be > 0 and each pool needs >= 1 device")

    def alone(self, devices: int) -> float:
        return min(1.0, self.cores / devices)

    @property
    def together(self) -> float:
        return min(1.0, self.cores / (self.trainer_devices + self.rollout_devices))


def _check(generate_s: float, train_s: float, push_s: float, max_staleness: int) -> None:
    if min(generate_s, train_s, push_s) < 0:
        raise ValueError(
            f"asynchronous model: seconds must be >= 0 (generation {generate_s}, trainer {train_s}, push {push_s})"
        )
    if not (isinstance(max_staleness, int) and max_staleness >= 0):
        raise ValueError(f"asynchronous model: max_staleness={max_staleness!r}; use 0 (synchronous), 1, 2, ...")


def _overlap(generate_s: float, train_s: float, sharing: Sharing | None) -> tuple[float, float]:
    """When generation and the trainer's side, started together, end (seconds from their start)."""
    if sharing is None:
        return generate_s, train_s
    ra, rb, both = sharing.alone(sharing.trainer_devices), sharing.alone(sharing.rollout_devices), sharing.together
    g, t = generate_s * rb, train_s * ra  # work at a device's full speed
    first = min(g, t) / both
    if g <= t:
        return first, first + (t - g) / ra
    return first + (g - t) / rb, first


def steady_iteration(
    generate_s: float, train_s: float, push_s: float, max_staleness: int, *, sharing: Sharing | None = None
) -> float:
    """Seconds per iteration in steady state: the sum (max_staleness=0), else the slower side + the push."""
    _check(generate_s, train_s, push_s, max_staleness)
    if max_staleness == 0:
        return generate_s + train_s + push_s
    return max(_overlap(generate_s, train_s, sharing)) + push_s


def trainer_seconds(
    call_seconds: Mapping[str, float],
    sets: Sequence[Sequence[str]] | None = None,
    levels: Mapping[str, int] | None = None,
) -> float:
    """The trainer side of one iteration from its calls' seconds. Calls on one pool take turns:
    with `sets` None every call shares the trainer's devices (the sum). With several sets (calls
    on disjoint devices) the sets run side by side within each dependency level (`levels`, e.g.
    `Dataflow.levels()`) and the levels one after another: HybridFlow's d_cost."""
    if sets is None:
        return sum(call_seconds.values())
    placed = [c for s in sets for c in s]
    missing = set(call_seconds) - set(placed)
    if missing or len(placed) != len(set(placed)):
        raise ValueError(
            f"trainer_seconds: every call in exactly one set; sets {list(sets)}, calls {list(call_seconds)}"
        )
    if levels is None:
        if len(sets) > 1:
            raise ValueError("trainer_seconds: several sets need the calls' dependency levels (Dataflow.levels())")
        return sum(call_seconds.values())
    n = 1 + max((levels[c] for c in call_seconds), default=0)
    per_level = [[sum(call_seconds.get(c, 0.0) for c in s if levels[c] == k) for s in sets] for k in range(n)]
    return sum(max(row) for row in per_level)


def hosted_iteration(
    generate_s: float,
    levels: Sequence[tuple[float, float]],
    push_s: float,
    max_staleness: int,
) -> float:
    """Seconds per steady iteration of a split plan whose rollout pool also hosts other models'
    calls (`placement.critic_beside="rollout"`: PPO's critic). `levels` are the dependency levels
    of the calls after generation (`Dataflow.levels()`), each (trainer pool's seconds, rollout
    pool's seconds), the calls of a level on one pool in turn and the pools side by side.

    max_staleness=0 (synchronous): generation, then the levels, then the push. Otherwise the
    next generation is launched once the first level's calls are queued (`algorithms.asynchronous`),
    so on the rollout pool it runs after that level's hosted calls and delays its later ones:
    with the critic hosted, max(R, V) + max(U_actor, G + U_critic) + W where the synchronous
    split takes G + max(R, V) + max(U_actor, U_critic) + W. With nothing hosted this is
    `steady_iteration`'s max(G, T) + W. Cores are not shared here (`sharing` is not modelled)."""
    _check(generate_s, sum(t for t, _ in levels), push_s, max_staleness)
    if any(min(level) < 0 for level in levels):
        raise ValueError(f"asynchronous model: seconds must be >= 0 (levels {list(levels)})")
    if max_staleness == 0:
        return generate_s + sum(max(level) for level in levels) + push_s
    start = rollout_free = 0.0  # when the level starts; when the rollout pool is free again
    for k, (trainer_s, hosted_s) in enumerate(levels):
        rollout_free = max(start, rollout_free) + hosted_s
        if k == 0:
            rollout_free += generate_s  # launched behind the first level's hosted calls
            end = max(start + trainer_s, rollout_free - generate_s)
        else:
            end = max(start + trainer_s, rollout_free)
        start = end
    return max(start, rollout_free) + push_s


@dataclass(frozen=True)
class PipelineSpan:
    """One bar of the pipeline's schedule."""

    side: str
    """ "rollout", "trainer" or "push" (both pools)."""
    iteration: int
    """The batch generated or trained; for a push, the update whose weights it carries (-1: the
    weights before the first update)."""
    start: float
    end: float


@dataclass(frozen=True)
class AsyncEstimate:
    """An asynchronous plan's iteration, and where its time goes."""

    iteration_s: float
    """Steady state: seconds from one update's end to the next."""
    total_s: float
    """`iterations` iterations, the pipeline's fill included: until the last update ends."""
    bottleneck: str
    """ "rollout" or "trainer": the side the other waits for."""
    idle_rollout: float
    """Fraction of a steady iteration the rollout pool waits (0 for the bottleneck)."""
    idle_trainer: float
    generate_s: float = 0.0
    train_s: float = 0.0
    push_s: float = 0.0
    max_staleness: int = 1
    iterations: int = 1
    source: str = "seconds given"
    """Where the seconds come from: one of SOURCES."""
    spans: tuple[PipelineSpan, ...] = field(default=(), repr=False)
    """The schedule of the `iterations` iterations."""

    @property
    def sequential_s(self) -> float:
        """The same split run synchronously (max_staleness=0): generation + trainer + push."""
        return self.generate_s + self.train_s + self.push_s

    @property
    def mean_iteration_s(self) -> float:
        """total_s / iterations: what a run this long averages, fill included."""
        return self.total_s / self.iterations

    @property
    def overlap_gain(self) -> float:
        """Sequential seconds over asynchronous seconds per steady iteration (1: no gain)."""
        return self.sequential_s / self.iteration_s if self.iteration_s else 1.0

    def describe(self) -> str:
        return (
            f"max_staleness {self.max_staleness}: {self.iteration_s:.3g} s/iteration in steady state "
            f"({self.overlap_gain:.2f}x the sequential {self.sequential_s:.3g} s; generation {self.generate_s:.3g} s, "
            f"trainer {self.train_s:.3g} s, push {self.push_s:.3g} s; {self.bottleneck}-bound, rollout idle "
            f"{self.idle_rollout:.0%}, trainer idle {self.idle_trainer:.0%}); {self.iterations} iteration(s) "
            f"{self.total_s:.3g} s [{self.source}]"
        )


def schedule(
    generate_s: float,
    train_s: float,
    push_s: float,
    max_staleness: int,
    iterations: int = 1,
    *,
    sharing: Sharing | None = None,
    initial_push: bool = True,
) -> tuple[PipelineSpan, ...]:
    """Start and end of every generation, trainer side and push of `iterations` iterations, in
    the runtime's order (see the module docstring), scheduled by TimeCost (`schedule.time_cost`,
    sharing cores when `sharing` says so). Generations launched ahead for batches past the last
    iteration are included: a real run launches them too."""
    _check(generate_s, train_s, push_s, max_staleness)
    if iterations < 1:
        raise ValueError(f"asynchronous model: iterations={iterations}; use >= 1")
    s, n = max_staleness, iterations
    na, nb = (sharing.trainer_devices, sharing.rollout_devices) if sharing else (1, 1)
    trainer, rollout = (0, na), (na, na + nb)
    # Costs at a device's full speed: TimeCost slows them back to `*_s` alone, more when shared.
    g_work = generate_s * (sharing.alone(nb) if sharing else 1.0)
    t_work = train_s * (sharing.alone(na) if sharing else 1.0)
    graph, meta = TaskGraph(), []
    first = []
    if initial_push:
        first.append(graph.add("push@-1", push_s))
        meta.append(("push", -1))
    gens: dict[int, int] = {}
    pushes: dict[int, int] = {}
    trains: dict[int, int] = {}

    def generation(j: int, after: list[int]) -> None:
        gens[j] = graph.add(f"gen@{j}", g_work, rollout, after)
        meta.append(("rollout", j))

    for j in range(s + 1):
        generation(j, [gens[j - 1]] if j else first)
    for k in range(n):
        trains[k] = graph.add(f"train@{k}", t_work, trainer, [gens[k]] + ([pushes[k - 1]] if k else first))
        meta.append(("trainer", k))
        if k == n - 1:
            break
        pushes[k] = graph.add(f"push@{k}", push_s, (), [trains[k], gens[k + s]])
        meta.append(("push", k))
        generation(k + s + 1, [pushes[k]])
    shared = (na + nb, sharing.cores) if sharing and sharing.cores < na + nb else None
    sch = time_cost(graph, shared)
    return tuple(PipelineSpan(side, i, sch.start[t], sch.end[t]) for t, (side, i) in enumerate(meta))


def estimate(
    generate_s: float,
    train_s: float,
    push_s: float,
    max_staleness: int,
    iterations: int = 1,
    *,
    sharing: Sharing | None = None,
    initial_push: bool = True,
    source: str = "seconds given",
) -> AsyncEstimate:
    """The iteration model of a split plan run with `max_staleness`, over `iterations` iterations:
    generation `generate_s` on the rollout pool, the trainer's side `train_s` (`trainer_seconds`),
    the weight push `push_s`, each as it runs alone."""
    if source not in SOURCES:
        raise ValueError(f"asynchronous model: source={source!r}; use one of {SOURCES}")
    step = steady_iteration(generate_s, train_s, push_s, max_staleness, sharing=sharing)
    spans = schedule(generate_s, train_s, push_s, max_staleness, iterations, sharing=sharing, initial_push=initial_push)
    total = max(sp.end for sp in spans if sp.side == "trainer")
    if max_staleness == 0:
        busy_rollout, busy_trainer = generate_s + push_s, train_s + push_s
    else:
        end_g, end_t = _overlap(generate_s, train_s, sharing)
        busy_rollout, busy_trainer = end_g + push_s, end_t + push_s
    return AsyncEstimate(
        iteration_s=step,
        total_s=total,
        bottleneck="rollout" if busy_rollout >= busy_trainer else "trainer",
        idle_rollout=max(0.0, 1 - busy_rollout / step) if step else 0.0,
        idle_trainer=max(0.0, 1 - busy_trainer / step) if step else 0.0,
        generate_s=generate_s,
        train_s=train_s,
        push_s=push_s,
        max_staleness=max_staleness,
        iterations=iterations,
        source=source,
        spans=spans,
    )


def from_measured(
    call_seconds: Mapping[str, float],
    push_s: float,
    max_staleness: int,
    iterations: int = 1,
    *,
    generate: Sequence[str] = ("gen",),
    other_s: float = 0.0,
    sets: Sequence[Sequence[str]] | None = None,
    levels: Mapping[str, int] | None = None,
    sharing: Sharing | None = None,
) -> AsyncEstimate:
    """The model from a run's measured seconds per call (e.g. a profile of the synchronous split
    run: its `timing_s/<call>` metrics and its `async.receive_weights` spans): the `generate`
    calls make the rollout's side, every other call the trainer's (`trainer_seconds` with `sets`
    and `levels`), plus `other_s` of driver-side work per iteration (advantages, data moves). Pass
    `sharing` when the seconds were measured with one side running at a time on shared cores;
    leave it None for seconds measured under the same overlap. Two things a synchronous profile
    does not show: a stale batch always recomputes pi_old, where a synchronous run may reuse the
    rollout's log-probs (add the `old_log_prob` call's seconds), and in an asynchronous run the
    driver-side `timing_s/gen` is the wait for a generation launched earlier, not its length (take
    the rollout's own span from the trace)."""
    unknown = [c for c in generate if c not in call_seconds]
    if unknown:
        raise ValueError(f"from_measured: no seconds for the generation call(s) {unknown}; calls: {list(call_seconds)}")
    gen = sum(call_seconds[c] for c in generate)
    rest = {c: t for c, t in call_seconds.items() if c not in generate}
    trainer = trainer_seconds(rest, sets, levels) + other_s
    return estimate(gen, trainer, push_s, max_staleness, iterations, sharing=sharing, source=MEASURED)
