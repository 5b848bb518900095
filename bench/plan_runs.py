"""Per-call plans run for real, beside the planner's estimates (issue 27): for one PPO workload on
this machine, the colocated plan, the auto-mapper's plan and the search's plan, each run headless
(`placement.plan`), the planner's estimated seconds per call and per iteration beside the measured
ones, and which plan is fastest by estimate and by measurement.

The fourth plan, shared_copy, generates on a copy over both devices while the actor trains on
one of them (a copy on devices its home shares). The fifth, replica, trains the critic over both
devices and computes its values on a replica on d1, reallocated into from both home ranks.

1. Profile this machine and fit the local cluster (`workbench.deploy.profiler.calibrate`), saved
   where the runs read it (`placement.calibration`): nothing the runs measure feeds the estimates.
2. Per round, each plan in turn (the machine is shared and noisy): a headless PPO run of the tiny
   10m model on 2 devices of one torch thread each. Its plan.yaml holds the estimate per call
   (`estimated_call_s`, dispatch included) and per iteration. Measured: each call's span in the
   trace (first rank's start to last rank's end; calls queued on one process are not counted
   while they wait) and the iteration (`timing_s/step`), medians over the iterations after
   --warmup.

    python bench/plan_runs.py [--rounds 2] [--iterations 4] [--warmup 1]

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import yaml

from workbench import Session
from workbench.deploy.profiler import calibrate
from workbench.models import make_tiny
from workbench.planner.measured import compare, measured_call_seconds
from workbench.run.config import load_config
from workbench.run.runner import Runner
from workbench.tracing import load_records

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "plan_runs"
CALLS = ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor")  # the run's dataflow
ONE_DEVICE = {"devices": 1, "first_device": 0}
PLANS = {
    "colocated": {"name": "colocated", "calls": {c: {"devices": 2} for c in CALLS}},
    "automap": "automap",
    "search": "search",
    # sixth_run's searched plan, before the planner priced the weight push: the actor trains on
    # d0 and generates on a copy over d0-1, which shares d0 with it.
    "shared_copy": {
        "name": "shared_copy",
        "calls": {
            "gen": {"devices": 2, "dp": 2},
            "old_log_prob": ONE_DEVICE,
            "ref": {"devices": 2, "dp": 2},
            "values": {"devices": 1, "first_device": 1},
            "update_critic": {"devices": 1, "first_device": 1},
            "update_actor": ONE_DEVICE,
        },
    },
    # The critic trains p1t1d2 over d0-1 and its values run on a replica on d1 (reallocated into
    # after each update); the actor and the reference on d0.
    "replica": {
        "name": "replica",
        "calls": {
            "gen": ONE_DEVICE,
            "old_log_prob": ONE_DEVICE,
            "ref": ONE_DEVICE,
            "values": {"devices": 1, "first_device": 1},
            "update_critic": {"devices": 2, "dp": 2},
            "update_actor": ONE_DEVICE,
        },
    },
}


def run_config(plan, name: str, model_dir: Path, calibration: Path, args, round_: int):
    rows = args.prompts * args.n
    config = load_config(
        None,
        [
            f"name=plan-{name}-r{round_}",
            f"model.path={model_dir}",
            f"logging.output_dir={OUT / name / f'round{round_}'}",
            f"iterations={args.warmup + args.iterations}",
            "algorithm.name=ppo",
            "algorithm.old_log_probs=recompute",  # every PPO call runs, as the planner's dataflow has it
            f"data.loader.batch_size={args.prompts}",
            f"sampling.n={args.n}",
            f"sampling.max_new_tokens={args.new_tokens}",
            f"actor.mini_batch_size={rows}",
            f"actor.micro_batch_size={rows // 2}",
            f"critic.mini_batch_size={rows}",
            f"critic.micro_batch_size={rows // 2}",
            "placement.num_devices=2",
            f"placement.calibration={calibration}",
            "logging.progress=false",
            "logging.rollouts_every=0",
            "logging.tensorboard=false",
            "evaluation.every=0",
            "checkpoint.every=0",
            "faults.max_recoveries=0",
        ],
    )
    config.placement.plan = plan  # a mapping does not fit a dotted override
    return config


def one_run(session, plan, name, model_dir, calibration, args, round_) -> dict:
    config = run_config(plan, name, model_dir, calibration, args, round_)
    Runner(config, session=session).run()
    out = config.output_dir
    record = yaml.safe_load((out / "plan.yaml").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing_s/step" in r][args.warmup :]
    measured = measured_call_seconds(load_records(out / "trace.jsonl"), CALLS, last=args.iterations)
    return {
        "plan": {k: record[k] for k in ("calls", "sets") if k in record},
        "estimated_call_s": record.get("estimated_call_s", {}),
        "estimated_iteration_s": record.get("estimated_iteration_s"),
        "measured_call_s": measured,
        "measured_iteration_s": statistics.median(r["timing_s/step"] for r in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    OUT.mkdir(parents=True, exist_ok=True)
    model_dir = make_tiny("10m", OUT / "tiny-10m", seed=0)
    calibration = OUT / "calibration.json"
    results: dict[str, list[dict]] = {name: [] for name in PLANS}
    with Session(num_devices=5, threads_per_worker=1) as session:  # the profiler: 1 + 4 devices
        calibrate(session, {"tiny-10m": str(model_dir)}).save(calibration)
        for round_ in range(args.rounds):
            for name, plan in PLANS.items():
                results[name].append(one_run(session, plan, name, model_dir, calibration, args, round_))
                last = results[name][-1]
                print(
                    f"[round {round_}] {name}: estimated {last['estimated_iteration_s']:.3f} s, "
                    f"measured {last['measured_iteration_s']:.3f} s",
                    flush=True,
                )
    table = {}
    for name, runs in results.items():
        measured = {c: statistics.median(r["measured_call_s"][c] for r in runs) for c in runs[0]["measured_call_s"]}
        it_meas = statistics.median(r["measured_iteration_s"] for r in runs)
        check = compare(runs[0]["estimated_call_s"], measured, runs[0]["estimated_iteration_s"], it_meas)
        table[name] = {"plan": runs[0]["plan"], **check}
        print(f"{name}: {json.dumps(table[name])}", flush=True)
    by_estimate = min(table, key=lambda n: table[n]["estimated_iteration_s"])
    by_measurement = min(table, key=lambda n: table[n]["measured_iteration_s"])
    errors = [abs(c["error"]) for t in table.values() for c in t["per_call"].values()]
    print(
        json.dumps(
            {
                "bench": "plan_runs",
                "plans": table,
                "fastest_by_estimate": by_estimate,
                "fastest_by_measurement": by_measurement,
                "max_iteration_error": max(abs(t["iteration_error"]) for t in table.values()),
                "max_call_error": max(errors) if errors else None,
                "settings": vars(args) | {"devices": 2, "threads_per_worker": 1, "model": "tiny 10m"},
            }
        )
    )


if __name__ == "__main__":
    main()
