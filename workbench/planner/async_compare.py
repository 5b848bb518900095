"""Asynchronous split plans beside synchronous ones: does generation on a pool of its own,
overlapping training, beat colocating everything?

    cmp = compare_async(Problem(dataflow_preset("grpo"), "llama2-7b", Workload(...), cluster_preset("h100", 8)))
    print(cmp.table())          # colocated, best synchronous, asynchronous split; who wins

`placement_estimates` answers the same question for `bench/async_rl.py`'s four placements on
this machine's calibrated cluster (colocated, split, async-s1, async-s2), from the cost model:

    est = placement_estimates("tiny-10m", "grpo", prompts=8, samples=4, prompt_len=16,
                              max_new_tokens=32, skip=("ref", "reward"), skip_synchronous=("old_log_prob",))
    est.iteration_s["async-s1"], est.tokens_per_s, est.pipelines["async-s1"].bottleneck
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from workbench.mesh import Mesh
from workbench.planner.asynchronous import COST_MODEL, AsyncEstimate, Sharing, estimate
from workbench.planner.automap import AutoMapper, automap_async
from workbench.planner.calibrate import DEFAULT_PATH, Calibration, load_calibration
from workbench.planner.dataflow import Dataflow
from workbench.planner.derive import dataflow_preset
from workbench.planner.errors import NoFeasiblePlanError
from workbench.planner.execution import DeviceRange, ExecutionPlan, PlanEvaluator
from workbench.planner.memory import static_memory
from workbench.planner.plan import AsyncPlan, Plan
from workbench.planner.problem import Problem
from workbench.planner.report import text_table
from workbench.planner.simulator import Simulator
from workbench.planner.specs import ClusterSpec, ModelSpec, Workload, model_preset


@dataclass
class AsyncComparison:
    """The best colocated plan, the best synchronous plan and the best asynchronous split plan
    of one scenario (HybridFlow auto-mapping; seconds per iteration from the cost model)."""

    colocated: Plan | None
    """Every model on every device (None: they do not fit together)."""
    synchronous: Plan
    """The best synchronous plan over every placement (`automap`)."""
    asynchronous: AsyncPlan | None
    """The best split with a rollout set of its own, run with `max_staleness` (None: none fits)."""

    @property
    def beats_colocation(self) -> bool:
        """Whether the asynchronous split is faster than colocating every model."""
        if self.asynchronous is None:
            return False
        return self.colocated is None or self.asynchronous.iteration_time < self.colocated.iteration_time

    @property
    def beats_synchronous(self) -> bool:
        return self.asynchronous is not None and self.asynchronous.iteration_time < self.synchronous.iteration_time

    @property
    def best(self) -> Plan:
        return self.asynchronous if self.beats_synchronous and self.asynchronous else self.synchronous

    def table(self) -> str:
        rows = []
        for name, plan in (("colocated", self.colocated), ("best synchronous", self.synchronous)):
            rows.append([name, plan.describe() if plan else "does not fit", _s(plan)])
        a = self.asynchronous
        if a is not None:
            rows.append(["split, synchronous", a.with_staleness(0).describe(), f"{a.synchronous_time:.2f}"])
        rows.append(["split, asynchronous", a.describe() if a else "does not fit", _s(a)])
        verdict = "beats" if self.beats_colocation else "does not beat"
        return text_table(["plan", "placement", "s/iteration"], rows) + f"\nthe asynchronous split {verdict} colocation"


def _s(plan: Plan | None) -> str:
    return f"{plan.iteration_time:.2f}" if plan else "-"


def compare_async(problem: Problem, max_staleness: int = 1, allocation: str | None = None) -> AsyncComparison:
    """Plan the scenario three ways (see AsyncComparison); `allocation` as `automap`'s."""
    mapper = AutoMapper(problem, allocation)
    synchronous = mapper.run()
    try:
        colocated: Plan | None = mapper.run([(problem.dataflow.models,)])
    except NoFeasiblePlanError:
        colocated = None
    try:
        asynchronous: AsyncPlan | None = automap_async(problem, max_staleness, allocation)
    except NoFeasiblePlanError:
        asynchronous = None
    return AsyncComparison(colocated, synchronous, asynchronous)


# ---- bench/async_rl.py's placements on this machine ----------------------------------------------
@dataclass
class PlacementEstimates:
    """The cost model's seconds per iteration of the asynchronous bench's placements."""

    iteration_s: dict[str, float]
    """Steady state per placement: "colocated", "split", "async-s1", "async-s2", ..."""
    total_s: dict[str, float]
    """`iterations` iterations from the start (the asynchronous pipeline's fill included)."""
    tokens_per_s: dict[str, float]
    """Response tokens (prompts x samples x max_new_tokens) per steady-state second."""
    pipelines: dict[str, AsyncEstimate] = field(default_factory=dict)
    """The split placements' iteration model: generation, trainer, push, bottleneck, idle."""
    cluster: ClusterSpec | None = None
    workload: Workload | None = None

    @property
    def best_sync(self) -> str:
        return min(("colocated", "split"), key=self.iteration_s.__getitem__)

    def ratio(self, placement: str) -> float:
        """Tokens/s of `placement` over the best synchronous placement's."""
        return self.tokens_per_s[placement] / self.tokens_per_s[self.best_sync]

    def as_dict(self) -> dict:
        """Plain numbers for a bench's JSON."""
        return {
            "iteration_s": self.iteration_s,
            "total_s": self.total_s,
            "tokens_per_s": self.tokens_per_s,
            "best_sync": self.best_sync,
            "pipelines": {
                k: {"generate_s": p.generate_s, "trainer_s": p.train_s, "push_s": p.push_s, "bottleneck": p.bottleneck}
                for k, p in self.pipelines.items()
            },
        }

    def describe(self) -> str:
        rows = [
            [k, f"{t:.3f}", f"{self.tokens_per_s[k]:.1f}", self.pipelines[k].describe() if k in self.pipelines else ""]
            for k, t in self.iteration_s.items()
        ]
        return text_table(["placement", "s/iteration", "tokens/s", "iteration model"], rows)


def placement_estimates(
    model: ModelSpec | str | os.PathLike,
    algorithm: str | Dataflow = "grpo",
    *,
    prompts: int,
    samples: int = 1,
    prompt_len: int,
    max_new_tokens: int,
    trainer_devices: int = 1,
    rollout_devices: int = 1,
    colocated_devices: int | None = None,
    lora_rank: int = 0,
    skip: Iterable[str] = (),
    skip_synchronous: Iterable[str] = (),
    staleness: Sequence[int] = (1, 2),
    iterations: int = 8,
    calibration: Calibration | str | os.PathLike | None = None,
    cluster: ClusterSpec | None = None,
) -> PlacementEstimates:
    """Seconds per iteration of `bench/async_rl.py`'s placements, from the cost model on this
    machine's calibrated cluster (`calibration`: a Calibration or the path of a saved one,
    default `.cache/planner/local-calibration.json`; or a `cluster` given outright):

    * "colocated": every call on all `colocated_devices` (default trainer + rollout devices),
      data parallel, the actor generating in its hybrid engine: TimeCost on the ReaLHF
      execution plan, as `bench/calibration.py` estimates a placement (cores shared as fitted);
    * "split": the trainer's calls on `trainer_devices`, generation on `rollout_devices` of a
      rollout group, synchronous (generation, trainer, push); "async-s<k>" for k in `staleness`:
      the same split with max_staleness k. The asynchronous iteration model
      (`asynchronous.estimate`) with the simulator's call times, the weight push
      (`Simulator.rollout_push_time`) and the two pools sharing the machine's fitted cores.

    model: a ModelSpec, a preset name ("tiny-10m") or a Hugging Face model directory (its
    config), trained with LoRA of `lora_rank` (0: full fine-tuning; the push then moves the
    adapters alone). algorithm: "grpo", "ppo" (or a Dataflow). prompts, samples, prompt_len,
    max_new_tokens: the batch (prompts x samples responses of max_new_tokens tokens; one optimizer
    step per iteration, one micro-batch per data-parallel rank, as the bench configures).
    skip: calls the runs do not make (a rule reward: "reward"; GRPO without a KL loss: "ref");
    skip_synchronous: calls only the synchronous runs skip ("old_log_prob" where they reuse the
    rollout's log-probs, which a stale batch cannot). iterations: the run length for `total_s`.
    """
    spec = _spec(model, lora_rank)
    flow = dataflow_preset(algorithm) if isinstance(algorithm, str) else algorithm
    base = _without(flow, set(skip))
    sync_flow = _without(base, set(skip_synchronous))
    specs = base.model_specs(spec)
    cal = None if cluster is not None else _calibration(calibration)
    n_split = trainer_devices + rollout_devices
    n_coloc = colocated_devices or n_split
    rows = prompts * samples

    def cluster_of(n: int) -> ClusterSpec:
        if cluster is not None:
            return replace(cluster, n_nodes=1, devices_per_node=n)
        assert cal is not None
        return cal.cluster(1, n)

    def workload(dp: int) -> Workload:
        return Workload(
            batch_size=prompts,
            n=samples,
            prompt_len=prompt_len,
            max_new_tokens=max_new_tokens,
            epochs=1,
            mini_batch_size=rows,  # one optimizer step per update
            micro_batch_size=math.ceil(rows / dp),
            gradient_checkpointing=False,
            param_sharding="full",
        )

    # Colocated: the path bench/calibration.py takes (ReaLHF TimeCost, shared cores).
    everywhere = (DeviceRange(0, n_coloc), Mesh(1, 1, n_coloc))
    evaluator = PlanEvaluator(Problem(sync_flow, spec, workload(n_coloc), cluster_of(n_coloc)), n_iterations=1)
    colocated = evaluator.evaluate(ExecutionPlan({c.name: everywhere for c in sync_flow.calls})).time
    iteration_s, total_s = {"colocated": colocated}, {"colocated": colocated * iterations}

    # Split: each side's seconds alone, then the iteration model.
    c = cluster_of(n_split)
    sim = Simulator(c, workload(trainer_devices))
    sharing = Sharing(c.cores_per_node, trainer_devices, rollout_devices) if c.cores_per_node is not None else None
    source = next(m for m in base.models if base.generates(m))
    gen_mesh, train_mesh = Mesh(1, 1, rollout_devices), Mesh(1, 1, trainer_devices)
    kv = c.device_memory - static_memory(specs[source], gen_mesh, False, "full").static
    gens = [k for k in base.calls if k.kind == "generate"]
    generate_s = sum(sim.call_time(k, specs[source], gen_mesh, kv, trained=False) for k in gens)
    push_s = sim.rollout_push_time(specs[source], train_mesh, gen_mesh, False, source)

    def trainer_s(f: Dataflow) -> float:
        calls = [k for k in f.calls if k.kind != "generate"]
        moved = sum(sim.data_transfer_time(sim.output_bytes(k), False) for k in gens)
        work = sum(sim.call_time(k, specs[k.model], train_mesh, trained=f.trained(k.model)) for k in calls)
        return work + moved + sim.driver_step_time(f)

    def alone(seconds: float, devices: int) -> float:  # the simulator's full speed -> one side running alone
        return seconds / sharing.alone(devices) if sharing else seconds

    g, w = alone(generate_s, rollout_devices), push_s
    sides = {0: alone(trainer_s(sync_flow), trainer_devices), 1: alone(trainer_s(base), trainer_devices)}
    pipelines = {
        name: estimate(g, sides[min(s, 1)], w, s, iterations, sharing=sharing, source=COST_MODEL)
        for name, s in [("split", 0), *((f"async-s{s}", s) for s in staleness)]
    }
    for k, p in pipelines.items():
        iteration_s[k], total_s[k] = p.iteration_s, p.total_s
    tokens = rows * max_new_tokens
    return PlacementEstimates(
        iteration_s,
        total_s,
        {k: tokens / t for k, t in iteration_s.items()},
        pipelines,
        c,
        workload(trainer_devices),
    )


def _spec(model: ModelSpec | str | os.PathLike, lora_rank: int) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model.with_lora(lora_rank) if lora_rank else model
    if isinstance(model, str) and not os.path.isdir(model):
        return model_preset(model).with_lora(lora_rank)
    return ModelSpec.from_model_dir(model, lora_rank)


def _calibration(calibration: Calibration | str | os.PathLike | None) -> Calibration:
    if isinstance(calibration, Calibration):
        return calibration
    return load_calibration(Path(calibration) if calibration is not None else DEFAULT_PATH)


def _without(flow: Dataflow, calls: set[str]) -> Dataflow:
    """The dataflow without `calls` (and without dependencies on them)."""
    unknown = calls - {c.name for c in flow.calls}
    if unknown:
        raise ValueError(
            f"skip: dataflow {flow.name!r} has no call(s) {sorted(unknown)}; calls: {[c.name for c in flow.calls]}"
        )
    kept = tuple(replace(c, deps=tuple(d for d in c.deps if d not in calls)) for c in flow.calls if c.name not in calls)
    return replace(
        flow, calls=kept, value_models=tuple(m for m in flow.value_models if any(c.model == m for c in kept))
    )
