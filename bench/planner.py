"""Planner benchmark: what HybridFlow auto-mapping picks on the paper's testbed, and why.

For PPO with Llama-2 7B/13B/34B/70B (all four models the same size, as in the HybridFlow
paper §8) on 8-128 A100-80GB (8 per machine; 1024 + 1024 tokens, batch 1024), it prints per
model and cluster size
  * the planner's best placement, allocation and layouts, with its time per dependency level
    (the paper's stages: generation | preparation | training) and the level that dominates;
  * beside it the three fixed placements (colocate: all on all devices; split: actor+reference
    | critic+reward; standalone: a set per model), each with its best allocation and layouts,
    so a reader sees what the choice gains and where;
  * which of the three (or "other") the planner picked, and how long auto-mapping took
    (goal: < 10 s per case on a 2-core machine);
  * the ReaLHF MCMC search (several chains, a step budget) on the same case: its best
    TimeCost against the auto-mapped plan's, and whether its chains agree.
The last line is one JSON object with stable keys.

    python bench/planner.py [--mcmc-steps 4000] [--chains 3]
"""

from __future__ import annotations

import argparse
import json
import math
import time

from workbench.planner import (
    ModelDoesNotFitError,
    NoFeasiblePlanError,
    PlanSpace,
    Problem,
    Workload,
    cluster_preset,
    dataflow_preset,
    multi_chain,
)
from workbench.planner.automap import AutoMapper

MODELS = ["llama2-7b", "llama2-13b", "llama2-34b", "llama2-70b"]
DEVICES = [8, 16, 32, 64, 128]
LEVELS = ("generation", "preparation", "training")  # the HybridFlow paper's stages
FIXED = {
    "colocate": (("actor", "reference", "critic", "reward"),),
    "split": (("actor", "reference"), ("critic", "reward")),
    "standalone": (("actor",), ("reference",), ("critic",), ("reward",)),
}


def _kind(placement) -> str:
    """colocate / split / standalone, "split, reward with the actor" (split with the two
    frozen models swapped: same shape, the smaller value-head model beside the actor), or
    other."""
    canon = lambda p: sorted(tuple(sorted(s)) for s in p)  # noqa: E731
    swapped = (("actor", "reward"), ("critic", "reference"))
    if canon(swapped) == canon(placement):
        return "split, reward with the actor"
    return next((k for k, v in FIXED.items() if canon(v) == canon(placement)), "other")


def _summary(plan) -> dict:
    levels = [round(t, 1) for t in plan.level_times]
    return {
        "placement": [s.name for s in plan.sets],
        "allocation": list(plan.allocation),
        "layouts": {
            m: a.strategy.short() + (f"|{a.generation.short()}" if a.generation else "")
            for s in plan.sets
            for m, a in s.assignments.items()
        },
        "iteration_s": round(plan.iteration_time, 2),
        "levels_s": levels,
        "dominant": LEVELS[max(range(len(levels)), key=levels.__getitem__)],
        "idle_devices": plan.stats["idle_devices"],
        "peak_memory_gb": round(plan.peak_memory / 1e9, 1),
    }


def run_case(model: str, n: int, mcmc_steps: int, chains: int) -> dict:
    flow, wl = dataflow_preset("ppo"), Workload()
    cluster = cluster_preset("a100_80g", n)
    case = {
        "model": model,
        "n_devices": n,
        "automap_s": None,
        "best": None,
        "pick": None,
        "fixed": {},
        "error": None,
        "mcmc": None,
    }
    problem = Problem(flow, model, wl, cluster)
    mapper = AutoMapper(problem)
    t0 = time.perf_counter()
    try:
        plan = mapper.run()
    except (ModelDoesNotFitError, NoFeasiblePlanError) as e:
        case["error"] = f"{type(e).__name__}: {e}"
        case["automap_s"] = round(time.perf_counter() - t0, 3)
        return case
    case["automap_s"] = round(time.perf_counter() - t0, 3)
    case["best"], case["pick"] = _summary(plan), _kind(plan.placement)
    for name, placement in FIXED.items():
        try:
            case["fixed"][name] = _summary(mapper.run([placement]))
        except NoFeasiblePlanError:
            case["fixed"][name] = None
    if mcmc_steps:
        space = PlanSpace(problem, n_iterations=2)
        automap_timecost = space.evaluator.evaluate(plan.to_execution_plan()).time
        r = multi_chain(space, tuple(range(chains)), max_steps=mcmc_steps, tolerance=0.05)
        case["mcmc"] = {
            "iter_s": round(r.evaluation.time, 2),
            "fits": not r.evaluation.oom,
            "automap_timecost_s": round(automap_timecost, 2),
            "vs_automap": round(r.evaluation.time / automap_timecost, 3),
            "chain_best": [round(c, 2) for c in r.convergence.best_costs],
            "chains_agree": r.convergence.agree,
            "spread": round(r.convergence.spread, 3),
        }
    return case


def _row(label: str, s: dict | None) -> str:
    if s is None:
        return f"  {label:<10} does not fit"
    place = " | ".join(f"{p}:{a}" for p, a in zip(s["placement"], s["allocation"]))
    levels = " | ".join(f"{t:6.1f}" for t in s["levels_s"])
    idle = f"  ({s['idle_devices']} idle)" if s["idle_devices"] else ""
    return (
        f"  {label:<10} {s['iteration_s']:8.1f} s  [{levels}]  {s['dominant']:<11} "
        f"{s['peak_memory_gb']:5.1f} GB  {place}{idle}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mcmc-steps", type=int, default=4000, help="MCMC proposals per chain (0: skip the search)")
    ap.add_argument("--chains", type=int, default=3)
    args = ap.parse_args()

    cases = []
    print(
        "per case: estimated s/iteration, [generation | preparation | training] s, dominant "
        "level, peak GB/device, placement:devices"
    )
    for model in MODELS:
        for n in DEVICES:
            c = run_case(model, n, args.mcmc_steps, args.chains)
            cases.append(c)
            print(f"\n{model} on {n} GPUs (auto-mapping {c['automap_s']:.2f} s)", flush=True)
            if c["error"]:
                print(f"  {c['error'].split(':')[0]}: {c['error'].split(': ', 1)[1][:110]}")
                continue
            print(_row("PLANNER", c["best"]) + f"   = {c['pick']}")
            print("             layouts: " + ", ".join(f"{m} {layout}" for m, layout in c["best"]["layouts"].items()))
            for name in FIXED:
                print(_row(name, c["fixed"][name]))
            if c["mcmc"]:
                m = c["mcmc"]
                print(
                    f"  MCMC       {m['iter_s']:8.1f} s TimeCost vs auto-mapped {m['automap_timecost_s']:.1f} s "
                    f"(x{m['vs_automap']:.2f}); chains {m['chain_best']} "
                    f"{'agree' if m['chains_agree'] else 'DISAGREE'}",
                    flush=True,
                )

    solved = [c for c in cases if c["best"]]
    ratios = [c["mcmc"]["vs_automap"] for c in solved if c["mcmc"] and c["mcmc"]["fits"]]
    max_s = max(c["automap_s"] for c in cases)
    picks = {k: sum(c["pick"] == k for c in solved) for k in (*FIXED, "split, reward with the actor", "other")}
    print(f"\nmax auto-mapping time {max_s:.2f}s (goal < 10 s); picks {picks}; monotone in devices: {_monotone(cases)}")
    print(
        json.dumps(
            {
                "bench": "planner",
                "max_automap_s": max_s,
                "automap_under_10s": max_s < 10,
                "picks": picks,
                "monotone": _monotone(cases),
                "mcmc_steps": args.mcmc_steps,
                "chains": args.chains,
                "geomean_mcmc_vs_automap": round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3)
                if ratios
                else None,
                "mcmc_chains_agree": sum(bool(c["mcmc"] and c["mcmc"]["chains_agree"]) for c in solved),
                "cases": cases,
            }
        )
    )


def _monotone(cases) -> bool:
    for model in MODELS:
        times = [c["best"]["iteration_s"] for c in cases if c["model"] == model and c["best"]]
        if any(b > a for a, b in zip(times, times[1:])):
            return False
    return True


if __name__ == "__main__":
    main()
