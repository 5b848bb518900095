"""Planner calibration: does the fitted `local` preset predict real PPO iterations here?

1. Profile this machine (`workbench.deploy.profiler`: model calls on one worker, gloo
   all-reduces, how workers share the cores) and fit the `local` cluster preset.
2. For several placements of the four PPO models (actor, reference, critic, reward model) on
   local Ray workers, one device per colocated set (and two placements with two: one data
   parallel with FSDP, one with the actor and reference tensor parallel, generating data
   parallel through the hybrid engine's switch), run real iterations of `algorithms.ppo`.
3. Compare with the planner's estimate for the same placement: TimeCost (ReaLHF list
   scheduling, with the fitted core sharing) over the simulator's call times under the fitted
   preset. Nothing measured in step 2 feeds the estimate.
Steps 1 and 2 alternate in rounds (profile, then one iteration of every placement): the
machine is shared, and a calibration only predicts runs made under the load it saw. Both
columns are medians over the rounds after the warm-up round.

Prints a table (placement, estimated s, measured s, relative error), whether the estimates
rank the placements in the measured order, the error broken down by step (each model call's
estimated seconds against its traced span, and the time outside every call: dispatch,
transfers and driver-side work), the fitted constants' spread over the rounds, and as the
last line one JSON object.

    python bench/calibration.py [--model 10m] [--iterations 3] [--calibration PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from itertools import combinations
from pathlib import Path

from algorithms.groups import Groups
from algorithms.ppo import PPO, PPOConfig
from workbench import Mesh, Session, steps
from workbench.data import arithmetic
from workbench.data.prompts import tokenize_prompts
from workbench.deploy.profiler import Profiler
from workbench.engines.rollout import SamplingConfig
from workbench.models import load, make_tiny
from workbench.planner import PlanEvaluator, Problem, Workload, cluster_preset, dataflow_preset
from workbench.planner.calibrate import load_calibration
from workbench.planner.execution import DeviceRange, ExecutionPlan
from workbench.planner.specs import ModelSpec
from workbench.workers import ActorConfig, ActorRolloutRefWorker
from workbench.workers.critic import CriticConfig, CriticWorker
from workbench.workers.reward import RewardModelWorker, ScoreModelConfig

ROLES = ("actor", "reference", "critic", "reward")
PLACEMENTS = {  # colocated sets; each set is one pool of one device unless DEVICES says more
    "colocate all": [ROLES],
    "actor+ref | critic+reward": [("actor", "reference"), ("critic", "reward")],
    "actor | ref+critic+reward": [("actor",), ("reference", "critic", "reward")],
    "actor+critic | ref+reward": [("actor", "critic"), ("reference", "reward")],
    "standalone": [(r,) for r in ROLES],
    "actor+ref | critic+reward, dp=2": [("actor", "reference"), ("critic", "reward")],
    "actor+ref tp=2 | critic+reward, dp=2": [("actor", "reference"), ("critic", "reward")],
}
DEVICES = {
    "actor+ref | critic+reward, dp=2": 2,  # data parallel: FSDP over 2 devices per set
    "actor+ref tp=2 | critic+reward, dp=2": 2,
}
# Roles trained and run tensor parallel over their set's devices (backend "3d"); the actor
# generates data parallel (gen_tp=1), so every generation pays the hybrid engine's switch.
TENSOR_PARALLEL = {"actor+ref tp=2 | critic+reward, dp=2": ("actor", "reference")}
MICRO, MINI = 4, 8
CONSTANTS = (
    "train_efficiency",
    "inference_efficiency",
    "bandwidth_efficiency",
    "step_overhead",
    "train_overhead",
    "inference_overhead",
    "sequence_overhead",
    "kernel_latency",
    "call_overhead",
    "collective_latency",
    "cores",
    "peak_flops",
)


def worker_specs(model_dir: str, tensor_parallel: bool = False) -> dict:
    backend = "3d" if tensor_parallel else "fsdp"
    return {
        "actor": (
            ActorRolloutRefWorker,
            ActorConfig(model_dir, backend=backend, micro_batch_size=MICRO, mini_batch_size=MINI),
        ),
        "reference": (
            ActorRolloutRefWorker,
            ActorConfig(model_dir, backend=backend, train=False, rollout=None, reference=True, micro_batch_size=MICRO),
        ),
        "critic": (CriticWorker, CriticConfig(model_dir, micro_batch_size=MICRO, mini_batch_size=MINI)),
        "reward": (RewardModelWorker, ScoreModelConfig(model_dir, micro_batch_size=MICRO)),
    }


def build(
    session: Session, tag: str, sets, devices: int, model_dir: str, cfg: PPOConfig, tp_roles: tuple[str, ...] = ()
) -> PPO:
    """PPO over fresh groups for one placement; roles get the tag so placements coexist."""
    groups = {}
    for i, roles in enumerate(sets):
        pool = session.pool(f"{tag}-set{i}", devices)
        tp = all(r in tp_roles for r in roles)
        specs = worker_specs(model_dir, tensor_parallel=tp)
        mesh = Mesh(tp=devices, gen_tp=1) if tp else None
        made = session.fused(pool, mesh=mesh, **{f"{tag}_{r}": specs[r] for r in roles})
        groups |= {r: made[f"{tag}_{r}"] for r in roles}
    return PPO(Groups(**groups), cfg)


def run_round(session: Session, algos: dict[str, PPO], prompts) -> tuple[dict, dict]:
    """Seconds of one PPO iteration per placement (placements take turns), and per placement
    its traced seconds per call plus the time outside every call."""
    times, traced = {}, {}
    for i, (name, algo) in enumerate(algos.items()):
        wall, start = time.time(), time.perf_counter()
        algo.step(prompts)
        times[name] = time.perf_counter() - start
        records = [r for r in session.trace() if r.start >= wall and r.role.startswith(f"p{i}_") and _model_call(r)]
        traced[name] = _traced_steps(records, wall, wall + times[name])
    return times, traced


def _model_call(record) -> bool:
    """A span of a step's worker call itself (its trace tag names the step, which is also the
    planner's call name), not one recorded inside it (hybrid.* transitions)."""
    step = steps.BY_NAME.get(record.extra.get("step"))
    return step is not None and record.method == step.worker_method


def _traced_steps(records, begin: float, end: float) -> dict[str, float]:
    """Per step: the longest rank's span; 'outside calls': the iteration's time no call covered."""
    out: dict[str, float] = {}
    for r in records:
        call = r.extra["step"]
        out[call] = max(out.get(call, 0.0), r.end - r.start)
    out["outside calls"] = (end - begin) - _union([(r.start, r.end) for r in records])
    return out


def _union(spans) -> float:
    total, reach = 0.0, None
    for a, b in sorted(spans):
        if reach is None or a > reach:
            total += b - a
            reach = b
        elif b > reach:
            total += b - reach
            reach = b
    return total


def estimate(
    sets, devices: int, spec: ModelSpec, workload: Workload, cluster, tp_roles: tuple[str, ...] = ()
) -> tuple[float, dict]:
    """The planner's seconds per iteration (`devices` per set, every call on its model's set,
    data parallel over them, or tensor parallel for `tp_roles` with data-parallel generation),
    and its seconds per call plus outside every call."""
    flow = dataflow_preset("ppo")
    home = {role: DeviceRange(i * devices, devices) for i, roles in enumerate(sets) for role in roles}

    def strategy(call):
        if call.model in tp_roles and call.kind != "generate":
            return Mesh(1, devices, 1)
        return Mesh(1, 1, devices)

    plan = ExecutionPlan({c.name: (home[c.model], strategy(c)) for c in flow.calls})
    evaluator = PlanEvaluator(Problem(flow, spec, workload, cluster), n_iterations=1)
    ev = evaluator.evaluate(plan)
    calls = {
        t.call: ev.schedule.end[i] - ev.schedule.start[i] for i, t in enumerate(ev.graph.tasks) if t.kind == "compute"
    }
    spans = [(ev.schedule.start[i], ev.schedule.end[i]) for i, t in enumerate(ev.graph.tasks) if t.kind == "compute"]
    calls["outside calls"] = ev.makespan - _union(spans)
    return ev.time, calls


def kendall_tau(a: list[float], b: list[float]) -> float:
    pairs = list(combinations(range(len(a)), 2))
    score = sum((a[i] - a[j]) * (b[i] - b[j]) > 0 for i, j in pairs) - sum(
        (a[i] - a[j]) * (b[i] - b[j]) < 0 for i, j in pairs
    )
    return score / len(pairs)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="10m", help="tiny-kit size for every role")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3, help="measured rounds")
    parser.add_argument("--workdir", type=Path, default=Path(".cache/bench/calibration"))
    parser.add_argument(
        "--calibration", type=Path, default=None, help="use a saved calibration instead of profiling each round"
    )
    parser.add_argument("--save", type=Path, default=Path(".cache/planner/local-calibration.json"))
    parser.add_argument(
        "--dump",
        type=Path,
        default=None,
        help="write every round's raw profile, measured times and traced steps here (to study the estimate offline)",
    )
    args = parser.parse_args(argv)
    load_start = os.getloadavg()
    started = time.perf_counter()

    model_dir = str(make_tiny(args.model, args.workdir / f"tiny-{args.model}"))
    loaded = load(model_dir)
    spec = ModelSpec.from_hf_config(loaded.model.config, f"kit-{args.model}")
    problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), args.prompts, seed=1)
    prompts = tokenize_prompts([p.__dict__ for p in problems], loaded.tokenizer, max_prompt_length=32)
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, n=args.samples, seed=0)
    cfg = PPOConfig(sampling=sampling)
    workload = Workload(
        batch_size=args.prompts,
        prompt_len=prompts["input_ids"].shape[1],
        max_new_tokens=args.new_tokens,
        n=args.samples,
        epochs=1,
        mini_batch_size=MINI,
        micro_batch_size=MICRO,
        gradient_checkpointing=False,
        param_sharding="full",
    )

    # Logical devices for every placement at once (19) plus the probes (5); only one
    # placement (or the profiler) computes at a time.
    rounds = []
    with Session(num_devices=24) as session:
        profiler = Profiler(session, {spec.name: model_dir})
        algos = {
            name: build(session, f"p{i}", sets, DEVICES.get(name, 1), model_dir, cfg, TENSOR_PARALLEL.get(name, ()))
            for i, (name, sets) in enumerate(PLACEMENTS.items())
        }
        for k in range(args.warmup + args.iterations):
            # Profile, then measure, every round: the machine is shared and its load drifts.
            cal = profiler.calibration() if args.calibration is None else load_calibration(args.calibration)
            cluster = cluster_preset("local", 4, calibration=cal)
            estimated = {
                name: estimate(sets, DEVICES.get(name, 1), spec, workload, cluster, TENSOR_PARALLEL.get(name, ()))
                for name, sets in PLACEMENTS.items()
            }
            est = {name: e[0] for name, e in estimated.items()}
            times, traced = run_round(session, algos, prompts)
            print(
                f"round {k}{' (warm-up)' if k < args.warmup else ''}: load {os.getloadavg()[0]:.1f}, "
                + ", ".join(f"{n}: est {est[n]:.2f} / {times[n]:.2f} s" for n in PLACEMENTS),
                flush=True,
            )
            if k >= args.warmup:
                rounds.append(
                    {
                        "calibration": cal,
                        "estimated": est,
                        "measured": times,
                        "steps": {n: (estimated[n][1], traced[n]) for n in PLACEMENTS},
                        "loadavg": round(os.getloadavg()[0], 2),
                    }
                )
            if args.dump:
                dumped = [
                    {
                        "calibration": r["calibration"].to_dict(),
                        "measured": r["measured"],
                        "traced": {n: r["steps"][n][1] for n in PLACEMENTS},
                        "loadavg": r["loadavg"],
                    }
                    for r in rounds
                ]
                args.dump.write_text(
                    json.dumps(
                        {"workload": dataclasses.asdict(workload), "spec": dataclasses.asdict(spec), "rounds": dumped},
                        indent=1,
                    )
                )
        profiler.close()
    cal.save(args.save)
    rows = []
    for name in PLACEMENTS:
        est = statistics.median(r["estimated"][name] for r in rounds)
        meas = statistics.median(r["measured"][name] for r in rounds)
        rows.append(
            {
                "placement": name,
                "estimated_s": round(est, 3),
                "measured_s": round(meas, 3),
                "rel_error": round(est / meas - 1, 3),
                "rounds": [[round(r["estimated"][name], 3), round(r["measured"][name], 3)] for r in rounds],
            }
        )

    step_rows = {}
    for name in PLACEMENTS:
        keys = list(rounds[0]["steps"][name][0])
        step_rows[name] = {
            k: [
                round(statistics.median(r["steps"][name][0].get(k, 0.0) for r in rounds), 3),
                round(statistics.median(r["steps"][name][1].get(k, 0.0) for r in rounds), 3),
            ]
            for k in keys
        }
    spread = {}
    for k in CONSTANTS:
        values = [getattr(r["calibration"], k) for r in rounds]
        mid = statistics.median(values)
        spread[k] = {
            "median": mid,
            "min": min(values),
            "max": max(values),
            "rel_spread": round((max(values) - min(values)) / mid, 3) if mid else 0.0,
        }

    print(
        "\nper step, estimated / traced seconds (median over rounds); 'outside calls' is the "
        "iteration time no model call covered (dispatch, transfers, driver-side work):"
    )
    calls = list(next(iter(step_rows.values())))
    print(f"{'placement':32s} " + " ".join(f"{c:>15s}" for c in calls))
    for name, row in step_rows.items():
        print(f"{name:32s} " + " ".join(f"{row[c][0]:6.2f} / {row[c][1]:5.2f}" for c in calls))
    print("\nfitted constants over the rounds (median, min - max, spread):")
    for k, v in spread.items():
        print(f"  {k:22s} {v['median']:.4g}  ({v['min']:.4g} - {v['max']:.4g}, {v['rel_spread']:.0%})")

    print("\nprofiled calls under the fit (measured s, predicted s):")
    for label, measured, predicted in cal.residuals():
        print(f"  {label:36s} {measured:7.3f} {predicted:7.3f} {predicted / measured - 1:+6.0%}")
    print(
        f"\nfitted local preset: peak {cal.peak_flops / 1e9:.0f} GFLOP/s/thread, train eff "
        f"{cal.train_efficiency:.2f}, inference eff {cal.inference_efficiency:.2f}, decode bandwidth "
        f"{cal.memory_bandwidth * cal.bandwidth_efficiency / 1e9:.1f} GB/s, step overhead "
        f"{cal.step_overhead * 1e3:.2f} ms, train overhead {cal.train_overhead * 1e3:.1f} ms/micro-batch, "
        "inference overhead "
        f"{cal.inference_overhead * 1e3:.1f} ms/micro-batch, "
        f"decoding {cal.sequence_overhead * 1e6:.0f} us/sequence/step, "
        f"all-reduce {cal.intra_node_bandwidth / 1e9:.2f} GB/s + "
        f"{cal.collective_latency * 1e3:.2f} ms, cores {cal.cores:.2f}, kernel "
        f"{cal.kernel_latency * 1e6:.1f} us, call overhead {cal.call_overhead * 1e3:.1f} ms"
    )
    print(
        f"\nPPO, {args.model} models, {args.prompts} prompts x {args.samples} samples x {args.new_tokens} tokens, "
        f"median of {args.iterations} rounds after {args.warmup} warm-up"
    )
    print(f"{'placement':28s} {'estimated s':>12s} {'measured s':>11s} {'rel error':>10s}")
    for r in rows:
        print(f"{r['placement']:28s} {r['estimated_s']:12.2f} {r['measured_s']:11.2f} {r['rel_error']:+10.1%}")
    est, meas = [r["estimated_s"] for r in rows], [r["measured_s"] for r in rows]
    tau = kendall_tau(est, meas)
    est_order = [r["placement"] for r in sorted(rows, key=lambda r: r["estimated_s"])]
    meas_order = [r["placement"] for r in sorted(rows, key=lambda r: r["measured_s"])]
    print(f"rank agreement: Kendall tau {tau:+.2f}; same order: {est_order == meas_order}")
    print(f"  estimated fastest->slowest: {est_order}\n  measured  fastest->slowest: {meas_order}")
    result = {
        "bench": "calibration",
        "model": args.model,
        "workload": {
            "prompts": args.prompts,
            "samples": args.samples,
            "new_tokens": args.new_tokens,
            "prompt_len": workload.prompt_len,
            "iterations": args.iterations,
            "warmup": args.warmup,
        },
        "max_rel_error": max(abs(r["rel_error"]) for r in rows),
        "mean_abs_rel_error": round(statistics.mean(abs(r["rel_error"]) for r in rows), 3),
        "placements": rows,
        "rank_agreement": {"kendall_tau": round(tau, 3), "same_order": est_order == meas_order},
        "fitted": {k: v for k, v in cal.to_dict().items() if k not in ("timings", "collectives", "machine")},
        "fitted_per_round": [{k: float(f"{getattr(r['calibration'], k):.4g}") for k in CONSTANTS} for r in rounds],
        "fitted_spread": {k: v["rel_spread"] for k, v in spread.items()},
        "steps": step_rows,
        "loadavg_per_round": [r["loadavg"] for r in rounds],
        "slowdown": cal.machine.get("slowdown"),
        "loadavg_start": [round(x, 2) for x in load_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "profile_s": cal.machine.get("profile_s"),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
