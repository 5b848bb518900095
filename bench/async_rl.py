"""Asynchronous RL against the best synchronous placement, on this machine's cores, in one run.

Placements, all on two devices of one torch thread each (the same cores, the same settings):
- `colocated`: the actor (training, HF rollout, reference) on both devices, data parallel, the
  critic beside it (PPO) — the hybrid engine, today's synchronous default;
- `split`: the actor (and critic) trains on one device, a rollout group generates on the other,
  synchronously (generate, then train, then push the weights);
- `split-cr` (PPO): the same, the critic in the rollout group's processes
  (placement.critic_beside=rollout): the reference beside the critic's values, the actor's update
  beside the critic's — PPO's fastest synchronous placement here;
- `async-s1`, `async-s2`: the same split, generation of the next batches overlapping training
  (algorithms.asynchronous) with max_staleness 1 and 2, truncated importance sampling on the stale
  rows (pi_old from the one-step update's own forward).
`async-cr-s1` is split-cr overlapped (the next generation launched once the step's scoring calls
are queued: between the critic's values and its update); the planner's model of both is
`asynchronous.hosted_iteration`, fitted on split-cr's call times.
A probe beyond two processes (`--placements split3,async3-s1,split4,async4-s1`): the actor, the
critic and a rollout group of 1 (or 2) devices, each process one thread, on the same 2 cores.
Each is a headless run (workbench.run.Runner) of GRPO and of PPO from the same briefly SFT'd tiny
model (bench/learning.py's, so rewards move), the arithmetic task, the same prompts in the same
order; round r samples with seed r. Rounds alternate the placements (the machine is shared and
noisy). Per placement: response tokens per second over the measured iterations (after
--warmup), and the training reward against wall-clock seconds since the first iteration began
(one PNG per algorithm). Ratios: each
asynchronous placement's tokens/s over the best synchronous one's (goal >= 1.3). The reward
curves are compared over the window every run covers: the mean reward of the iterations each
finished by then (`gap_*`: asynchronous minus best synchronous; >= 0 means its curve is not below)
and where each curve stands at the window's end.

The planner's model of an asynchronous iteration (steady state = the slower side + the weight
transfer) is put beside the measurement: from the split synchronous run's measured call times
(generation, trainer-side calls, weight push), its prediction for s=1 and s=2 against what the
asynchronous runs measured (goal: within 25%).
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from learning import prepare_model, split  # bench/learning.py: the SFT'd starting point

from workbench import Session
from workbench.data import arithmetic
from workbench.data.prompts import write_jsonl
from workbench.run.config import load_config
from workbench.run.runner import Runner

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "async_rl"
PLACEMENTS = {  # name: run-config overrides
    "colocated": ("placement.actor_devices=2", "placement.critic_devices=0"),
    "split": ("placement.actor_devices=1", "placement.critic_devices=0", "placement.rollout_devices=1"),
    "split-cr": (
        "placement.actor_devices=1",
        "placement.critic_devices=0",
        "placement.rollout_devices=1",
        "placement.critic_beside=rollout",
    ),
    "async-cr-s1": (
        "placement.actor_devices=1",
        "placement.critic_devices=0",
        "placement.rollout_devices=1",
        "placement.critic_beside=rollout",
        "asynchronous.enabled=true",
        "asynchronous.max_staleness=1",
        "algorithm.off_policy_correction=tis",
    ),
    "split3": ("placement.actor_devices=1", "placement.critic_devices=1", "placement.rollout_devices=1"),
    "async3-s1": (
        "placement.actor_devices=1",
        "placement.critic_devices=1",
        "placement.rollout_devices=1",
        "asynchronous.enabled=true",
        "asynchronous.max_staleness=1",
        "algorithm.off_policy_correction=tis",
    ),
    "split4": ("placement.actor_devices=1", "placement.critic_devices=1", "placement.rollout_devices=2"),
    "async4-s1": (
        "placement.actor_devices=1",
        "placement.critic_devices=1",
        "placement.rollout_devices=2",
        "asynchronous.enabled=true",
        "asynchronous.max_staleness=1",
        "algorithm.off_policy_correction=tis",
    ),
    "async-s1": (
        "placement.actor_devices=1",
        "placement.critic_devices=0",
        "placement.rollout_devices=1",
        "asynchronous.enabled=true",
        "asynchronous.max_staleness=1",
        "algorithm.off_policy_correction=tis",
    ),
    "async-s2": (
        "placement.actor_devices=1",
        "placement.critic_devices=0",
        "placement.rollout_devices=1",
        "asynchronous.enabled=true",
        "asynchronous.max_staleness=2",
        "algorithm.off_policy_correction=tis",
    ),
}


CRITIC_PLACED = ("split-cr", "async-cr-s1")
"""Placements that differ from split / async-s1 only in where the critic runs."""
DEFAULT_PLACEMENTS = ("colocated", "split", "split-cr", "async-s1", "async-s2")
"""The others (3 or 4 processes on the same 2 cores) were a probe: see results/async_rl/NOTES.md."""


def run_config(algo: str, placement: str, model_dir: Path, data: dict[str, Path], args, round_: int):
    rows = args.prompts * (args.n if algo == "grpo" else 1)
    devices = 2 if placement == "colocated" else 1
    return load_config(
        None,
        [
            f"name={algo}-{placement}-r{round_}",
            f"model.path={model_dir}",
            f"logging.output_dir={OUT / algo / placement / f'round{round_}'}",
            f"iterations={args.warmup + args.iterations}",
            f"algorithm.name={algo}",
            "data.task=arithmetic",
            f"data.train_file={data['train']}",
            f"data.eval_file={data['eval']}",
            f"data.loader.batch_size={args.prompts}",
            "data.loader.max_prompt_length=32",
            f"sampling.n={args.n if algo == 'grpo' else 1}",
            f"sampling.max_new_tokens={args.new_tokens}",
            f"sampling.min_new_tokens={args.min_new_tokens}",
            f"sampling.seed={round_}",  # each round its own samples: the reward curves average over rounds
            f"actor.mini_batch_size={rows}",
            f"actor.micro_batch_size={rows // devices}",
            f"critic.mini_batch_size={rows}",
            f"critic.micro_batch_size={rows // devices}",
            f"actor.optim.lr={args.lr}",
            f"critic.optim.lr={args.lr}",
            "algorithm.kl_loss_coef=0.0" if algo == "grpo" else f"algorithm.kl_coef={args.kl_coef}",
            "logging.progress=false",
            "logging.rollouts_every=0",
            "logging.tensorboard=false",
            "evaluation.every=0",
            "checkpoint.every=0",
            "faults.max_recoveries=0",
            *PLACEMENTS[placement],
        ],
    )


def one_run(session, algo: str, placement: str, model_dir: Path, data: dict, args, round_: int) -> dict:
    """A headless run; per iteration its end time, response tokens, training reward and step times."""
    points: list[dict] = []
    started = time.time()

    def note(algorithm, batch, metrics) -> None:
        points.append(
            {
                "t": time.time() - started,
                "tokens": float(batch["response_mask"].sum()),
                "score": metrics["critic/score/mean"],
                **{k: v for k, v in metrics.items() if k.startswith(("timing_s/", "async/"))},
            }
        )

    Runner(run_config(algo, placement, model_dir, data, args, round_), session=session, callbacks=[note]).run()
    trace = session.trace()
    # The clock starts when the first iteration began, not when the run started its workers.
    first = points[0]["t"] - points[0]["timing_s/step"]
    for p in points:
        p["t"] -= first
    return {"points": points, "pushes": push_seconds(trace, since=started)}


def push_seconds(records, since: float) -> list[float]:
    """Seconds of each weight push to the rollout group (the receiving side's span)."""
    return [r.end - r.start for r in records if r.start >= since and r.method == "async.receive_weights"]


def tokens_per_s(points: list[dict], warmup: int) -> float:
    measured = points[warmup:]
    return sum(p["tokens"] for p in measured) / (points[-1]["t"] - points[warmup - 1]["t"])


def modelled_async(split_runs: list[dict], async_runs: list[dict], warmup: int) -> dict[str, float]:
    """The planner's asynchronous iteration (steady state: the slower side + the weight push),
    from measured call times: generation and the trainer's side from the split synchronous runs
    (their `timing_s/gen` is the generation itself; in an asynchronous run it is only the wait),
    plus any pi_old recompute that a stale batch needs and a synchronous one skips (its
    `timing_s/old_log_prob` in the asynchronous runs; none where the one-step update's own forward
    gives pi_old, old_log_probs="auto" -> "update")."""
    from workbench.planner.asynchronous import steady_iteration

    def median(key: str, runs: list[dict]) -> float:
        values = [p[key] for run in runs for p in run["points"][warmup:] if key in p]
        return statistics.median(values) if values else 0.0

    gen, step = median("timing_s/gen", split_runs), median("timing_s/step", split_runs)
    recompute = median("timing_s/old_log_prob", async_runs) if not median("timing_s/old_log_prob", split_runs) else 0.0
    push = statistics.median(s for run in split_runs for s in run["pushes"]) if split_runs[0]["pushes"] else 0.0
    trainer = step - gen + recompute  # everything of the synchronous step after the generation
    return {
        "gen_s": gen,
        "trainer_s": trainer,
        "recompute_s": recompute,
        "push_s": push,
        **{f"s{s}": steady_iteration(gen, trainer, push, s) for s in (0, 1, 2)},
    }


def modelled_hosted(split_cr_runs: list[dict], warmup: int) -> dict[str, float]:
    """The planner's model of PPO with the critic in the rollout's processes
    (`asynchronous.hosted_iteration`), from the synchronous `split-cr` runs' call times: the
    reference beside the critic's values, the driver's work, the actor's update beside the
    critic's; s0 is fitted (the driver's share is what the calls leave of the step), s1 is the
    prediction for the same placement overlapped (`async-cr-s1`)."""
    from workbench.planner.asynchronous import hosted_iteration

    def median(key: str) -> float:
        return statistics.median(p[key] for run in split_cr_runs for p in run["points"][warmup:])

    gen, ref, values = median("timing_s/gen"), median("timing_s/ref"), median("timing_s/values")
    actor, critic = median("timing_s/update_actor"), median("timing_s/update_critic")
    push = statistics.median(s for run in split_cr_runs for s in run["pushes"])
    other = max(0.0, median("timing_s/step") - gen - max(ref, values) - max(actor, critic) - push)
    levels = [(ref, values), (other, 0.0), (actor, critic)]
    return {
        "gen_s": gen,
        "ref_s": ref,
        "values_s": values,
        "update_actor_s": actor,
        "update_critic_s": critic,
        "driver_s": other,
        "push_s": push,
        **{f"s{s}": hosted_iteration(gen, levels, push, s) for s in (0, 1)},
    }


def reward_by(points: list[dict], horizon: float, window: int = 4) -> tuple[float, float]:
    """The training reward a run reached by `horizon` seconds: the mean score of the iterations
    finished by then (the area under its reward-vs-time curve, as a step function) and the
    moving mean of the last `window` of them (where the curve stands at the horizon)."""
    scores = [p["score"] for p in points if p["t"] <= horizon] or [points[0]["score"]]
    return statistics.mean(scores), statistics.mean(scores[-window:])


def reward_comparison(runs: dict[str, list[dict]], sync_best: str) -> dict:
    """Each placement's reward over the wall-clock window every run covers (up to the earliest
    finish among them), and each asynchronous placement's gap to the best synchronous one
    (>= 0: its curve is not below)."""
    horizon = min(run["points"][-1]["t"] for placement_runs in runs.values() for run in placement_runs)
    reached = {
        p: [statistics.mean(v) for v in zip(*(reward_by(r["points"], horizon) for r in placement_runs))]
        for p, placement_runs in runs.items()
    }
    out: dict = {
        "horizon_s": round(horizon, 1),
        "mean_reward_by_horizon": {p: round(v[0], 3) for p, v in reached.items()},
        "reward_at_horizon": {p: round(v[1], 3) for p, v in reached.items()},
    }
    for p in runs:
        if p.startswith("async"):
            out[f"gap_{p}"] = round(reached[p][0] - reached[sync_best][0], 3)
    return out


def plot(algo: str, runs: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for placement, placement_runs in runs.items():
        # Iteration k of every round: its mean end time and score, then a moving mean of 4.
        rounds = [run["points"] for run in placement_runs]
        ts = [statistics.mean(points[k]["t"] for points in rounds) for k in range(len(rounds[0]))]
        score = [statistics.mean(points[k]["score"] for points in rounds) for k in range(len(rounds[0]))]
        smooth = [statistics.mean(score[max(0, k - 3) : k + 1]) for k in range(len(score))]
        ax.plot(ts, smooth, label=placement, alpha=0.9)
    ax.set_xlabel("wall-clock seconds since the run's first iteration began")
    ax.set_ylabel(f"training reward (mean of {len(rounds)} rounds, moving mean of 4)")
    ax.set_title(f"{algo.upper()}: synchronous vs asynchronous, 2 cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    global OUT  # --out moves the runs (run_config reads it)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algos", default="grpo,ppo")
    parser.add_argument("--placements", default=",".join(DEFAULT_PLACEMENTS))
    parser.add_argument("--prompts", type=int, default=8, help="prompts per iteration")
    parser.add_argument("--n", type=int, default=4, help="GRPO samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--min-new-tokens",
        type=int,
        default=32,
        help="responses run at least this long (the SFT'd model answers in ~4 tokens, which leaves "
        "nothing but fixed costs to overlap); the arithmetic score reads the answer's first number",
    )
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--kl-coef", type=float, default=0.0)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--threads-per-process", type=int, default=1, help="torch threads per worker process (16 cores: 4)"
    )
    parser.add_argument("--out", type=Path, default=OUT, help="run folders, charts and runs.json")
    args = parser.parse_args()
    OUT = args.out

    cfg = arithmetic.ArithmeticConfig(digits=2, min_digits=1)
    heldout, sft, rl = split(cfg, 64, 4000, 64 * args.prompts)
    model_dir = prepare_model(cfg, sft, 400, 3e-4)
    OUT.mkdir(parents=True, exist_ok=True)
    rows = lambda problems: ({"prompt": p.prompt, "ground_truth": p.ground_truth} for p in problems)  # noqa: E731
    data = {"train": write_jsonl(rows(rl), OUT / "train.jsonl"), "eval": write_jsonl(rows(heldout), OUT / "eval.jsonl")}

    placements = args.placements.split(",")
    results: dict = {}
    with Session(num_devices=4, threads_per_worker=args.threads_per_process) as session:
        for algo in args.algos.split(","):
            # The critic's placement makes a difference only where there is a critic.
            runs: dict[str, list[dict]] = {p: [] for p in placements if algo == "ppo" or p not in CRITIC_PLACED}
            for round_ in range(args.rounds):
                for placement in runs:
                    runs[placement].append(one_run(session, algo, placement, model_dir, data, args, round_))
                    tps = tokens_per_s(runs[placement][-1]["points"], args.warmup)
                    print(f"[{algo} round {round_}] {placement}: {tps:.1f} tokens/s", flush=True)
            tps = {p: statistics.median(tokens_per_s(r["points"], args.warmup) for r in runs[p]) for p in runs}
            sync_best = max((p for p in runs if not p.startswith("async")), key=tps.__getitem__)
            measured_it = {
                p: statistics.median(
                    (r["points"][-1]["t"] - r["points"][args.warmup - 1]["t"]) / args.iterations for r in runs[p]
                )
                for p in runs
            }
            entry = {
                "tokens_per_s": {p: round(v, 1) for p, v in tps.items()},
                "iteration_s": {p: round(v, 3) for p, v in measured_it.items()},
                "best_sync": sync_best,
                **{f"ratio_{p}": round(tps[p] / tps[sync_best], 3) for p in runs if p.startswith("async")},
                "final_score": {p: round(statistics.mean(r["points"][-1]["score"] for r in runs[p]), 3) for p in runs},
                "mean_score": {
                    p: round(statistics.mean(pt["score"] for r in runs[p] for pt in r["points"]), 3) for p in runs
                },
                "reward_vs_wallclock": reward_comparison(runs, sync_best),
            }
            if "split" in runs:
                asynchronous = [r for p in runs if p.startswith("async") for r in runs[p]]
                model = modelled_async(runs["split"], asynchronous, args.warmup)
                entry["planner"] = {k: round(v, 3) for k, v in model.items()}
                for p in runs:
                    if p.startswith("async-s"):
                        s = int(p.removeprefix("async-s"))
                        entry[f"planner_error_{p}"] = round(model[f"s{s}"] / measured_it[p] - 1, 3)
            if "split-cr" in runs:
                hosted = modelled_hosted(runs["split-cr"], args.warmup)
                entry["planner_split_cr"] = {k: round(v, 3) for k, v in hosted.items()}
                if "async-cr-s1" in runs:
                    entry["planner_error_async-cr-s1"] = round(hosted["s1"] / measured_it["async-cr-s1"] - 1, 3)
            plot(algo, runs, OUT / f"{algo}_reward_vs_wallclock.png")
            (OUT / f"{algo}_runs.json").write_text(json.dumps(runs))  # to re-plot or re-compare
            results[algo] = entry
            print(f"[{algo}] {json.dumps(entry)}", flush=True)
    ratios = [v for r in results.values() for k, v in r.items() if k.startswith("ratio_")]
    print(
        json.dumps(
            {
                "bench": "async_rl",
                "ratio_min": min(ratios) if ratios else None,
                "cases": results,
                "settings": {
                    k: getattr(args, k)
                    for k in (
                        "prompts",
                        "n",
                        "new_tokens",
                        "min_new_tokens",
                        "lr",
                        "kl_coef",
                        "warmup",
                        "iterations",
                        "rounds",
                    )
                }
                | {"devices": 2, "threads_per_worker": args.threads_per_process}
                | {"model": "tiny 10m, SFT'd (bench/learning.py)"},
            }
        )
    )


if __name__ == "__main__":
    main()
