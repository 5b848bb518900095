"""Planner benchmark: HybridFlow auto-mapping runtime, and ReaLHF MCMC vs auto-mapping.

For PPO with Llama-2 7B/13B/34B/70B (all four models the same size, as in the HybridFlow
paper) on 8-128 A100-80GB (paper testbed figures), it prints
  * how long auto-mapping (Alg. 1) takes and the placement + allocation it picks
    (goal: < 10 s per case on a 2-core machine; the paper reports up to ~half an hour);
  * the estimated iteration time of the MCMC-searched plan (ReaLHF, from the greedy plan,
    fixed time budget) vs the auto-mapped plan, both scored by the same TimeCost on a
    2-iteration unrolled graph (so both may overlap consecutive iterations).
The last line is one JSON object with stable keys.

    python bench/planner.py [--mcmc-seconds 3] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import time

from workbench.planner import (ModelDoesNotFitError, NoFeasiblePlanError, PlanSpace, Workload,
                               automap, cluster_preset, dataflow_preset, mcmc)

MODELS = ["llama2-7b", "llama2-13b", "llama2-34b", "llama2-70b"]
DEVICES = [8, 16, 32, 64, 128]


def run_case(model: str, n: int, mcmc_seconds: float, seed: int) -> dict:
    flow, wl = dataflow_preset("ppo"), Workload()
    cluster = cluster_preset("a100_80g", n)
    case = {"model": model, "n_devices": n, "automap_s": None, "placement": None,
            "allocation": None, "automap_iter_s": None, "automap_timecost_s": None,
            "mcmc_iter_s": None, "mcmc_fits": None, "mcmc_steps": 0,
            "mcmc_vs_automap": None, "error": None}
    t0 = time.perf_counter()
    plan = None
    try:
        plan = automap(flow, model, wl, cluster)
    except (ModelDoesNotFitError, NoFeasiblePlanError) as e:
        case["error"] = f"{type(e).__name__}: {e}"
    case["automap_s"] = round(time.perf_counter() - t0, 3)
    if isinstance(case["error"], str) and case["error"].startswith("ModelDoesNotFit"):
        return case
    space = PlanSpace(flow, flow.model_specs(model), wl, cluster, n_iterations=2)
    if plan is not None:
        case["placement"] = ["+".join(s.models) for s in plan.sets]
        case["allocation"] = list(plan.allocation)
        case["automap_iter_s"] = round(plan.iteration_time, 2)
        case["automap_timecost_s"] = round(
            space.evaluator.evaluate(plan.to_execution_plan()).time, 2)
    r = mcmc(space, time_limit=mcmc_seconds, seed=seed)
    case["mcmc_iter_s"] = round(r.evaluation.time, 2)
    case["mcmc_fits"] = not r.evaluation.oom
    case["mcmc_steps"] = r.steps
    if plan is not None and case["mcmc_fits"]:
        case["mcmc_vs_automap"] = round(r.evaluation.time / case["automap_timecost_s"], 3)
    return case


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mcmc-seconds", type=float, default=3.0,
                    help="MCMC time limit per case (ReaLHF uses minutes)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    cases = []
    print(f"{'model':<11} {'N':>4} {'automap s':>9}  {'placement : allocation':<52} "
          f"{'d_cost':>8} {'TimeCost':>8} {'MCMC':>8} {'ratio':>6}")
    for model in MODELS:
        for n in DEVICES:
            c = run_case(model, n, args.mcmc_seconds, args.seed)
            cases.append(c)
            if c["placement"]:
                place = " | ".join(f"{p}:{a}" for p, a in zip(c["placement"], c["allocation"]))
            else:
                place = (c["error"] or "").split(":")[0]
            fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
            mc = fmt(c["mcmc_iter_s"]) + ("" if c["mcmc_fits"] in (None, True) else "!")
            ratio = "-" if c["mcmc_vs_automap"] is None else f"{c['mcmc_vs_automap']:.2f}"
            print(f"{model:<11} {n:>4} {c['automap_s']:>9.2f}  {place:<52} "
                  f"{fmt(c['automap_iter_s']):>8} {fmt(c['automap_timecost_s']):>8} "
                  f"{mc:>8} {ratio:>6}", flush=True)

    ratios = [c["mcmc_vs_automap"] for c in cases if c["mcmc_vs_automap"] is not None]
    max_s = max(c["automap_s"] for c in cases)
    print(f"\nmax auto-mapping time {max_s:.2f}s (goal < 10 s); MCMC/automap estimated "
          f"iteration time: geomean {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f} "
          f"over {len(ratios)} cases (< 1 means the searched plan is faster). '!' = MCMC best "
          f"plan out of memory. Times in seconds per iteration; d_cost is HybridFlow's stage "
          f"model, TimeCost the list-scheduled 2-iteration estimate.")
    print(json.dumps({
        "bench": "planner",
        "max_automap_s": max_s,
        "automap_under_10s": max_s < 10,
        "mcmc_seconds": args.mcmc_seconds,
        "geomean_mcmc_vs_automap": round(math.exp(sum(map(math.log, ratios)) / len(ratios)), 3)
        if ratios else None,
        "mcmc_better_cases": sum(r < 1 for r in ratios),
        "compared_cases": len(ratios),
        "cases": cases,
    }))


if __name__ == "__main__":
    main()
