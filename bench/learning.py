"""Do the algorithms learn? GRPO and PPO on the arithmetic task with the ~10M tiny model, and
Safe-RLHF keeping a cost under its budget (issue 5's learning goals), all in one run.

- start: make_tiny("10m"), briefly SFT'd on arithmetic demonstrations (cached under .cache/),
  so that held-out greedy accuracy starts well below its ceiling and RL has room.
- GRPO, PPO: each from the same SFT checkpoint on fresh groups, until held-out greedy exact
  match has risen by --target-gain points (on --confirm evaluations in a row), or --max-cpu-min
  of CPU time / --max-wall-min of wall time / --max-iterations, whichever comes first.
  Goal: +15 points within 30 CPU minutes.
- Safe-RLHF: the same start, a rule cost that forbids some answers (so reward and cost
  conflict: some correct answers are unsafe), a budget below the SFT policy's cost rate.
  Goal: mean cost under the budget (by the end) while reward rises.

Held-out prompts are never trained on: SFT and RL problems with a held-out expression are
dropped. CPU time is the user + system time of this process and every process under it (the
embedded Ray's GCS, raylet and workers), read with psutil; evaluation time is not counted
in `cpu_min` (it is in `cpu_min_with_eval`). Each algorithm is a headless run of
workbench.run's Runner (its metrics.jsonl, TensorBoard events, rollouts and trace under
runs/learning/<algorithm>/); curves are written as PNGs under runs/learning/.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import psutil
import torch

from workbench import Session
from workbench.data import arithmetic
from workbench.data.prompts import write_jsonl
from workbench.models import make_tiny
from workbench.run.config import RunConfig
from workbench.run.runner import Runner
from workbench.stages import StageConfig, train_sft

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "learning"


# ---- the task --------------------------------------------------------------------------------
def split(cfg: arithmetic.ArithmeticConfig, n_heldout: int, n_sft: int, n_rl: int):
    """Held-out, SFT and RL problems; no SFT or RL problem shares an expression with held-out."""
    heldout, seen = [], set()
    for p in arithmetic.generate(cfg, 4 * n_heldout, seed=1):
        if p.expression not in seen and len(heldout) < n_heldout:
            heldout.append(p)
            seen.add(p.expression)
    sft = [p for p in arithmetic.generate(cfg, n_sft, seed=0) if p.expression not in seen]
    rl = [p for p in arithmetic.generate(cfg, n_rl, seed=2) if p.expression not in seen]
    return heldout, sft, rl


def prepare_model(cfg: arithmetic.ArithmeticConfig, sft: list, steps: int, lr: float) -> Path:
    """The 10M tiny model after `steps` of SFT on the demonstrations (cached by settings)."""
    name = f"sft-d{cfg.digits}m{cfg.min_digits}{''.join(cfg.operations)}-n{len(sft)}-s{steps}-lr{lr:g}"
    sft_dir = CACHE / name
    if not (sft_dir / "config.json").exists():
        torch.set_num_threads(1)
        base = make_tiny("10m", CACHE / "base-10m")
        start = time.monotonic()
        result = train_sft(base, arithmetic.demonstrations(sft), sft_dir, StageConfig(steps=steps, lr=lr, log_every=0))
        print(
            f"SFT: loss {result['first_loss']:.2f} -> {result['last_loss']:.2f} in {steps} steps "
            f"({time.monotonic() - start:.0f} s)"
        )
    return sft_dir


# ---- measuring -------------------------------------------------------------------------------
class CPUClock:
    """CPU seconds (user + system) of this process and all its descendants; a process that
    exits keeps its last reading, so the total never goes back."""

    def __init__(self):
        self.me = psutil.Process()
        self.last: dict[tuple[int, float], float] = {}

    def seconds(self) -> float:
        for proc in [self.me, *self.me.children(recursive=True)]:
            try:
                t = proc.cpu_times()
                self.last[(proc.pid, proc.create_time())] = t.user + t.system
            except psutil.Error:
                pass
        return sum(self.last.values())


class BenchRunner(Runner):
    """The runner, with its held-out evaluations timed apart (their CPU is not training's) and
    printed as curve points; a callback stops the run at the gain or when a budget runs out."""

    def __init__(self, name: str, config, session, args, cpu: CPUClock, stop_on_gain: bool):
        super().__init__(config, session=session, callbacks=[self.after_iteration])
        self.name, self.args, self.cpu, self.stop_on_gain = name, args, cpu, stop_on_gain
        self.curve: list[dict] = []
        self.cpu0 = self.wall0 = None
        self.eval_cpu = self.eval_wall = 0.0
        self.hits, self.stopped_by = 0, "max_iterations"

    def evaluate(self) -> dict[str, float]:
        if self.cpu0 is None:  # the clock starts at the first evaluation, once the groups are up
            self.cpu0, self.wall0 = self.cpu.seconds(), time.monotonic()
        c, w = self.cpu.seconds(), time.monotonic()
        out = super().evaluate()
        self.eval_cpu += self.cpu.seconds() - c
        self.eval_wall += time.monotonic() - w
        point = {
            "acc": out["eval/score"],
            **({"cost": out["eval/cost"]} if "eval/cost" in out else {}),
            "iteration": self.algorithm.iteration,
            "cpu_min": (self.cpu.seconds() - self.cpu0 - self.eval_cpu) / 60,
            "wall_min": (time.monotonic() - self.wall0 - self.eval_wall) / 60,
        }
        self.curve.append(point)
        if point["iteration"] == 0:
            self.print_point(point)
        return out

    def print_point(self, point: dict) -> None:
        extra = f" cost {point['cost']:.3f}" if "cost" in point else ""
        print(
            f"[{self.name}] it {point['iteration']:3d}  held-out acc {point['acc']:.3f}{extra}  "
            f"cpu {point['cpu_min']:.1f} min  wall {point['wall_min']:.1f} min",
            flush=True,
        )

    def after_iteration(self, algo, batch, metrics) -> bool:
        it = algo.iteration
        keys = ("critic/score/mean", "safe/cost/mean", "safe/lambda", "actor/pg_loss", "timing_s/step")
        print(
            f"[{self.name}] it {it:3d}  " + "  ".join(f"{k} {metrics[k]:.3f}" for k in keys if k in metrics), flush=True
        )
        if "eval/score" not in metrics:
            return True
        point = self.curve[-1]
        self.print_point(point)
        gain = (point["acc"] - self.curve[0]["acc"]) * 100
        self.hits = self.hits + 1 if gain >= self.args.target_gain else 0
        if self.stop_on_gain and self.hits >= self.args.confirm:
            self.stopped_by = "target_gain"
        elif point["cpu_min"] >= self.args.max_cpu_min:
            self.stopped_by = "max_cpu_min"
        elif point["wall_min"] >= self.args.max_wall_min:
            self.stopped_by = "max_wall_min"
        else:
            return True
        return False

    def summary(self) -> dict:
        start, end = self.curve[0], self.curve[-1]
        return {
            "start_acc": round(start["acc"], 4),
            "end_acc": round(end["acc"], 4),
            "best_acc": round(max(p["acc"] for p in self.curve), 4),
            "gain_points": round((end["acc"] - start["acc"]) * 100, 1),
            "cpu_min": round(end["cpu_min"], 2),
            "wall_min": round(end["wall_min"], 2),
            "cpu_min_with_eval": round((self.cpu.seconds() - self.cpu0) / 60, 2),
            "iterations": end["iteration"],
            "stopped_by": self.stopped_by,
            "curve": self.curve,
            "history": self.algorithm.history,
        }


# ---- the runs ------------------------------------------------------------------------------
def run_config(name: str, model_dir: Path, data: dict[str, Path], args) -> RunConfig:
    """The run as a workbench.run config: actor(+reference) on one device, critic(s) on another."""
    algorithm = {
        "grpo": {"kl_loss_coef": args.kl},
        "ppo": {"kl_coef": args.kl},
        "safe_rlhf": {
            "kl_coef": args.kl,
            "cost_budget": args.cost_budget,
            "lambda_init": args.lambda_init,
            "lambda_lr": args.lambda_lr,
        },
    }[name]
    rows = {"mini_batch_size": args.mini_batch, "micro_batch_size": args.mini_batch}
    return RunConfig.from_dict(
        {
            "name": name,
            "iterations": args.safe_iterations if name == "safe_rlhf" else args.max_iterations,
            "model": {"path": str(model_dir)},
            "data": {
                "train_file": str(data["train"]),
                "eval_file": str(data["heldout"]),
                "cost": {"forbidden": args.forbidden.split(",")},
                "loader": {"batch_size": args.prompts, "max_prompt_length": 32, "shuffle": False, "drop_last": True},
            },
            "placement": {"actor_devices": 1, "critic_devices": 1},
            "algorithm": {"name": name, **algorithm},
            "sampling": {
                "max_new_tokens": args.max_new_tokens,
                "n": args.n,
                "temperature": args.temperature,
                "seed": None,
            },
            "actor": {"optim": {"lr": args.actor_lr}, "epochs": 1, **rows},
            "critic": {"optim": {"lr": args.critic_lr}, **rows},
            "logging": {"output_dir": str(args.out / name), "progress": False, "rollouts_every": args.eval_every},
            "evaluation": {"every": args.eval_every, "at_start": True},
            "checkpoint": {"every": 0},
            "faults": {"max_recoveries": 0},
        }
    )


def run(name: str, session, model_dir: Path, data: dict[str, Path], args, cpu: CPUClock) -> dict:
    runner = BenchRunner(
        name, run_config(name, model_dir, data, args), session, args, cpu, stop_on_gain=name != "safe_rlhf"
    )
    runner.run()
    result = runner.summary()
    if name != "safe_rlhf":
        return result
    hist, k = result["history"], max(1, min(5, len(result["history"]) // 4))

    def mean(key, rows):
        return round(sum(r[key] for r in rows) / len(rows), 4)

    result |= {
        "cost_budget": args.cost_budget,
        "forbidden": args.forbidden,
        "window": k,
        "mean_cost_first": mean("safe/cost/mean", hist[:k]),
        "mean_cost_last": mean("safe/cost/mean", hist[-k:]),
        "reward_first": mean("critic/score/mean", hist[:k]),
        "reward_last": mean("critic/score/mean", hist[-k:]),
        "lambda_first": round(hist[0]["safe/lambda"], 4),
        "lambda_last": round(hist[-1]["safe/lambda"], 4),
        "lambda_max": round(max(r["safe/lambda"] for r in hist), 4),
        "heldout_cost_first": round(result["curve"][0]["cost"], 4),
        "heldout_cost_last": round(result["curve"][-1]["cost"], 4),
    }
    return result


# ---- report ----------------------------------------------------------------------------------
def plot(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, (by_it, by_cpu) = plt.subplots(1, 2, figsize=(11, 4))
    for name in ("grpo", "ppo"):
        if name in results:
            curve = results[name]["curve"]
            by_it.plot([p["iteration"] for p in curve], [100 * p["acc"] for p in curve], "o-", label=name.upper())
            by_cpu.plot([p["cpu_min"] for p in curve], [100 * p["acc"] for p in curve], "o-", label=name.upper())
    for ax, xlabel in ((by_it, "iteration"), (by_cpu, "CPU minutes (training, all processes)")):
        start = next((r["start_acc"] for r in results.values() if "start_acc" in r), None)
        if start is not None:
            ax.axhline(100 * start + 15, color="grey", ls="--", lw=1, label="start + 15 points")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out greedy exact match (%)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("GRPO and PPO on arithmetic, ~10M tiny Llama after SFT")
    fig.tight_layout()
    paths.append(out_dir / "accuracy.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    if "safe_rlhf" in results:
        safe = results["safe_rlhf"]
        hist, curve = safe["history"], safe["curve"]
        its = [h["iteration"] for h in hist]
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
        left.plot(its, [h["critic/score/mean"] for h in hist], label="reward (sampled)")
        left.plot(its, [h["safe/cost/mean"] for h in hist], label="cost (sampled)")
        left.plot([p["iteration"] for p in curve], [p["acc"] for p in curve], "o--", label="reward (held-out greedy)")
        left.plot([p["iteration"] for p in curve], [p["cost"] for p in curve], "s--", label="cost (held-out greedy)")
        left.axhline(safe["cost_budget"], color="red", ls=":", label="cost budget")
        left.set_xlabel("iteration")
        left.legend(fontsize=8)
        left.grid(alpha=0.3)
        right.plot(its, [h["safe/lambda"] for h in hist], color="purple")
        right.set_xlabel("iteration")
        right.set_ylabel("Lagrange multiplier lambda")
        right.grid(alpha=0.3)
        fig.suptitle(f"Safe-RLHF: answers matching {safe['forbidden']!r} cost 1, budget {safe['cost_budget']}")
        fig.tight_layout()
        paths.append(out_dir / "safe_rlhf.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def table(results: dict) -> str:
    lines = [
        f"{'algorithm':<10} {'start':>6} {'end':>6} {'gain':>6} {'cpu min':>8} {'wall min':>9} {'iters':>6}  stopped by"
    ]
    for name in ("grpo", "ppo", "safe_rlhf"):
        if name in results:
            r = results[name]
            lines.append(
                f"{name:<10} {r['start_acc']:>6.3f} {r['end_acc']:>6.3f} {r['gain_points']:>+6.1f} "
                f"{r['cpu_min']:>8.1f} {r['wall_min']:>9.1f} {r['iterations']:>6}  {r['stopped_by']}"
            )
    if "safe_rlhf" in results:
        r = results["safe_rlhf"]
        lines.append(
            f"safe_rlhf: budget {r['cost_budget']}, "
            f"sampled cost {r['mean_cost_first']:.3f} -> {r['mean_cost_last']:.3f}, "
            f"reward {r['reward_first']:.3f} -> {r['reward_last']:.3f} (means of first/last {r['window']} iterations), "
            f"lambda {r['lambda_first']:.3f} -> {r['lambda_last']:.3f} (max {r['lambda_max']:.3f}); "
            f"held-out greedy cost {r['heldout_cost_first']:.3f} -> {r['heldout_cost_last']:.3f}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", default="grpo,ppo,safe_rlhf")
    task = parser.add_argument_group("task and SFT")
    task.add_argument("--digits", type=int, default=2)
    task.add_argument("--min-digits", type=int, default=1)
    task.add_argument("--operations", default="+")
    task.add_argument("--heldout", type=int, default=256, help="held-out prompts (greedy exact match)")
    task.add_argument("--sft-examples", type=int, default=4000)
    task.add_argument("--sft-steps", type=int, default=400)
    task.add_argument("--sft-lr", type=float, default=3e-4)
    task.add_argument("--model", type=Path, help="start from this checkpoint instead of the cached SFT")
    rl = parser.add_argument_group("RL")
    rl.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    rl.add_argument("--n", type=int, default=8, help="samples per prompt")
    rl.add_argument("--temperature", type=float, default=1.0)
    rl.add_argument("--max-new-tokens", type=int, default=6)
    rl.add_argument("--actor-lr", type=float, default=3e-5)
    rl.add_argument("--critic-lr", type=float, default=1e-4)
    rl.add_argument("--mini-batch", type=int, default=64, help="rows per optimizer step")
    rl.add_argument("--kl", type=float, default=0.01, help="kl_loss_coef (GRPO) / kl_coef (PPO, Safe-RLHF)")
    budget = parser.add_argument_group("budget")
    budget.add_argument("--target-gain", type=float, default=15.0, help="points of held-out accuracy")
    budget.add_argument("--confirm", type=int, default=2, help="evaluations in a row at the target before stopping")
    budget.add_argument("--max-cpu-min", type=float, default=30.0)
    budget.add_argument("--max-wall-min", type=float, default=30.0)
    budget.add_argument("--max-iterations", type=int, default=200)
    budget.add_argument("--eval-every", type=int, default=5)
    safe = parser.add_argument_group("Safe-RLHF")
    safe.add_argument("--forbidden", default="7", help="comma-separated regexes; a matching answer costs 1")
    safe.add_argument(
        "--cost-budget",
        type=float,
        default=0.03,
        help="below the SFT policy's cost (about 0.1), so the constraint binds",
    )
    safe.add_argument("--lambda-init", type=float, default=1.0)
    safe.add_argument("--lambda-lr", type=float, default=2.0)
    safe.add_argument("--safe-iterations", type=int, default=30)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "learning")
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)

    cfg = arithmetic.ArithmeticConfig(digits=args.digits, min_digits=args.min_digits, operations=tuple(args.operations))
    heldout_problems, sft_problems, rl_problems = split(cfg, args.heldout, args.sft_examples, 64 * args.prompts)
    model_dir = args.model or prepare_model(cfg, sft_problems, args.sft_steps, args.sft_lr)
    # The runner reads prompts from files: RL problems in order (batch i of the run is rows
    # i*prompts.., cycled), and the held-out set.
    data = {
        "train": write_jsonl(
            ({"prompt": p.prompt, "ground_truth": p.ground_truth} for p in rl_problems), args.out / "data" / "rl.jsonl"
        ),
        "heldout": write_jsonl(
            ({"prompt": p.prompt, "ground_truth": p.ground_truth} for p in heldout_problems),
            args.out / "data" / "heldout.jsonl",
        ),
    }
    print(
        f"task: {cfg.digits}-digit (min {cfg.min_digits}) {cfg.operations}; {len(heldout_problems)} held-out, "
        f"{len(sft_problems)} SFT and {len(rl_problems)} RL problems (none shares a held-out expression)"
    )

    load0 = os.getloadavg()
    cpu = CPUClock()
    results = {}
    with Session(num_devices=2) as session:  # actor+reference on one device, critic(s) on the other
        for name in args.algorithms.split(","):
            results[name] = run(name, session, model_dir, data, args, cpu)
            paths = plot(results, args.out)  # after each algorithm, so a cut-short run keeps its curves
            (args.out / "results.json").write_text(
                json.dumps({"results": results, "settings": vars(args)}, default=str, indent=1)
            )
    load1 = os.getloadavg()

    print(table(results))
    print("curves: " + ", ".join(str(p) for p in paths))
    summary = {name: {k: v for k, v in r.items() if k not in ("curve", "history")} for name, r in results.items()}
    for name in ("grpo", "ppo"):
        if name in summary:
            summary[name]["goal_met"] = summary[name]["gain_points"] >= 15 and summary[name]["cpu_min"] <= 30
    if "safe_rlhf" in summary:
        s = summary["safe_rlhf"]
        s["goal_met"] = s["mean_cost_last"] <= s["cost_budget"] and s["reward_last"] > s["reward_first"]
    print(
        json.dumps(
            {
                "bench": "learning",
                "model": "10m",
                **summary,
                "cpu_time": "user+system of the driver and every descendant process (Ray GCS, raylet, workers), "
                "evaluation excluded",
                "loadavg_start": [round(x, 2) for x in load0],
                "loadavg_end": [round(x, 2) for x in load1],
                "cores": os.cpu_count(),
                "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "goal_gain_points": 15,
                "goal_cpu_min": 30,
            }
        )
    )


if __name__ == "__main__":
    main()
