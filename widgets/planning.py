"""The explorer's planning questions, answered with the planner's public pieces.

`estimate(Scenario)` plans one scenario: HybridFlow auto-mapping over every placement
("auto"), or the best allocation and layouts for one fixed placement ("colocate", "split",
"standalone", "custom", "async split"). It returns an `Estimate`: the Plan, or the reason nothing
fits (which model or set, short by how many GiB per device). Results are cached per scenario, so
moving a slider back and forth costs nothing the second time.

"async split" is asynchronous RL's placement (`workbench.planner.automap_async`): generation on a
rollout group with devices of its own, every other model on the rest, generation overlapping
training up to `max_staleness` updates (0: the same split run synchronously). "auto" with
`max_staleness` >= 1 weighs those plans against the synchronous ones. Either way the estimate
also holds the best colocated plan's time, so the explorer can say whether the split with
overlap beats colocation.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from pathlib import Path

from workbench import checks
from workbench.planner import (
    AsyncPlan,
    AutoMapper,
    ModelDoesNotFitError,
    Plan,
    PlannerError,
    Problem,
    Workload,
    automap_async,
    cluster_preset,
    compositions,
    d_cost,
    dataflow_preset,
    model_preset,
)
from workbench.planner.memory import min_static_memory

GIB = 1024**3
DEVICE_TYPES = {"this machine": "local", "A100 80GB": "a100_80g", "H100": "h100", "H200": "h200"}
ALGORITHMS = {"PPO": "ppo", "GRPO": "grpo", "ReMax": "remax", "Safe-RLHF": "safe_rlhf"}
PLACEMENTS = ("auto", "colocate", "split", "standalone", "custom", "async split")
CALIBRATION = Path(".cache/planner/local-calibration.json")
"""Where `workbench.planner.calibrate` saves this machine's fitted figures (used when present)."""


@dataclass(frozen=True)
class Scenario:
    """One point of the explorer: hardware, models, workload, algorithm and placement."""

    machines: int = 1
    """Machines in the cluster."""
    devices_per_machine: int = 4
    """Accelerators per machine (CPU slots on this machine)."""
    device: str = "this machine"
    """A key of DEVICE_TYPES."""
    actor: str = "tiny-1m"
    """Model preset of the actor and its reference."""
    critic: str = "tiny-1m"
    """Model preset of the critic and cost critic (value head)."""
    reward: str = "tiny-1m"
    """Model preset of the reward and cost models (value head)."""
    batch_size: int = 16
    """Prompts per iteration."""
    n: int = 2
    """Responses per prompt."""
    prompt_len: int = 32
    """Prompt tokens per sequence."""
    max_new_tokens: int = 32
    """Generated tokens per sequence."""
    algorithm: str = "PPO"
    """A key of ALGORITHMS."""
    placement: str = "auto"
    """One of PLACEMENTS."""
    custom: tuple[tuple[str, int], ...] = ()
    """For placement "custom": (model, set number) pairs; models left out go to set 0."""
    max_staleness: int = 0
    """Asynchronous RL's bound: how many updates old the weights generating a batch may be.
    Placement "async split" runs with it (0: synchronously); "auto" with >= 1 also weighs
    asynchronous split plans."""

    @property
    def n_devices(self) -> int:
        return self.machines * self.devices_per_machine


@dataclass
class Estimate:
    """The planner's answer for one Scenario."""

    scenario: Scenario
    plan: Plan | None
    """The best plan found, or None when nothing fits."""
    error: str | None = None
    """Why nothing fits: which model or set, short by how much."""
    reshard: dict[str, float] = field(default_factory=dict)
    """Seconds of each generation call spent switching the actor from its training to its
    generation layout (3D-HybridEngine), included in the call's time."""
    seconds: float = 0.0
    """Planning time."""
    colocated_time: float | None = None
    """For an asynchronous plan: seconds per iteration of the best colocated plan (every model
    on every device, synchronous), which the split with overlap has to beat; None if it does not fit."""

    @property
    def asynchronous(self) -> AsyncPlan | None:
        return self.plan if isinstance(self.plan, AsyncPlan) else None


def cluster_for(s: Scenario):
    """The cluster spec of a scenario: `machines` x `devices_per_machine` of the device type."""
    name = DEVICE_TYPES[s.device]
    calibration = CALIBRATION if name == "local" and CALIBRATION.exists() else None
    one = cluster_preset(name, n_nodes=s.machines, calibration=calibration)
    return dataclasses.replace(one, devices_per_node=s.devices_per_machine)


@functools.cache
def dataflow_for(algorithm: str):
    return dataflow_preset(ALGORITHMS[algorithm])


def workload_for(s: Scenario) -> Workload:
    """The scenario's batch shape as the planner's Workload (at most 8 mini- and micro-batches)."""
    return Workload(
        batch_size=s.batch_size,
        n=s.n,
        prompt_len=s.prompt_len,
        max_new_tokens=s.max_new_tokens,
        mini_batch_size=-(-s.batch_size * s.n // min(8, s.batch_size)),
        micro_batch_size=min(8, s.batch_size * s.n),
    )


def model_specs(s: Scenario, models: tuple[str, ...]) -> dict:
    preset = {"actor": s.actor, "reference": s.actor, "critic": s.critic, "cost_critic": s.critic}
    return {m: model_preset(preset.get(m, s.reward)) for m in models}


def placement_sets(s: Scenario, models: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """The colocated sets a named placement means for these models."""
    if s.placement == "colocate":
        return (models,)
    if s.placement == "standalone":
        return tuple((m,) for m in models)
    if s.placement == "split":  # HybridFlow's split: the policy pair apart from everything else
        policy = tuple(m for m in models if m in ("actor", "reference"))
        rest = tuple(m for m in models if m not in policy)
        return tuple(p for p in (policy, rest) if p)
    if s.placement == "custom":
        chosen = dict(s.custom)
        numbers = sorted({chosen.get(m, 0) for m in models})
        return tuple(tuple(m for m in models if chosen.get(m, 0) == k) for k in numbers)
    raise ValueError(f"placement {s.placement!r}: use one of {PLACEMENTS}")


@functools.lru_cache(maxsize=512)
def estimate(s: Scenario) -> Estimate:
    """Plan `s` (cached): see the module docstring."""
    t0 = time.perf_counter()
    checks.one_of("Scenario", "placement", s.placement, PLACEMENTS)
    flow = dataflow_for(s.algorithm)
    cluster = cluster_for(s)
    workload = workload_for(s)
    checks.whole("Scenario", "max_staleness", s.max_staleness, low=0, fix="use 0 (synchronous), 1, 2, ...")
    problem = Problem(flow, model_specs(s, flow.models), workload, cluster)
    mapper = AutoMapper(problem)
    plan: Plan
    try:
        mapper.check_each_model_fits()
        if s.placement == "async split":
            plan = automap_async(problem, s.max_staleness)
        elif s.placement == "auto":
            plan = mapper.run()
            if s.max_staleness:
                try:
                    split = automap_async(problem, s.max_staleness)
                    plan = split if split.iteration_time < plan.iteration_time else plan
                except PlannerError:  # no split fits: the synchronous plan stands
                    pass
        else:
            plan = _fixed(mapper, placement_sets(s, flow.models))
    except ModelDoesNotFitError as e:
        return Estimate(
            s,
            None,
            f"{e.model} does not fit: it needs {e.need_bytes / GIB:.1f} GiB per device "
            f"even sharded over all {e.n_devices} devices; a device has "
            f"{e.device_bytes / GIB:.1f} GiB (short by {e.short_bytes / GIB:.1f} GiB)",
            seconds=time.perf_counter() - t0,
        )
    except PlannerError as e:
        return Estimate(s, None, str(e), seconds=time.perf_counter() - t0)
    reshard = {}
    for c in flow.calls:
        if c.kind == "generate":
            a = plan.set_of(c.model).assignments[c.model]
            if a.generation is not None:
                reshard[c.name] = mapper.sim.reshard_time(a.spec, a.strategy, a.generation)
    colocated = None
    if isinstance(plan, AsyncPlan):
        try:
            colocated = _fixed(mapper, (flow.models,)).iteration_time
        except PlannerError:  # every model on every device does not fit: nothing to beat
            pass
    return Estimate(s, plan, None, reshard, time.perf_counter() - t0, colocated)


def _fixed(mapper: AutoMapper, sets: tuple[tuple[str, ...], ...]) -> Plan:
    """HybridFlow Alg. 1 restricted to one placement: the cheapest allocation of devices."""
    n, q = mapper.cluster.n_devices, mapper.cluster.device_memory
    if len(sets) > n:
        raise PlannerError(f"{len(sets)} colocated sets need at least {len(sets)} devices; the cluster has {n}")
    mins = []
    for models in sets:
        least = mapper.min_devices(models, n - len(sets) + 1)
        if least is None:
            floor = sum(min_static_memory(mapper.specs[m], n, mapper.flow.trained(m)) for m in models)
            raise PlannerError(
                f"set {'+'.join(models)} does not fit on the {n - len(sets) + 1} devices it can get: its weights, "
                f"gradients and optimizer state alone need {floor / GIB:.1f} GiB per device sharded over all "
                f"{n}, a device has {q / GIB:.1f} GiB"
                + (
                    f" (short by {(floor - q) / GIB:.1f} GiB)"
                    if floor > q
                    else "; activations and KV cache take the rest"
                )
                + "; split the set, add devices or shrink the models"
            )
        mins.append(least)
    best = None
    for alloc in compositions(n, mins):
        costs = [mapper.set_cost(models, k) for models, k in zip(sets, alloc)]
        if any(c is None for c in costs):
            continue
        cost = d_cost([c[0] for c in costs])
        if best is None or cost < best[0]:
            best = (cost, sets, alloc)
    if best is None:
        raise PlannerError(f"no allocation of {n} devices fits the sets {['+'.join(m) for m in sets]} together")
    # The planner's own builder turns the choice into a Plan (packed devices, layouts, memory).
    return mapper._build(best, {"placements": 1, "allocations": 0, "seconds": 0.0, "strategy_cache": 0})
