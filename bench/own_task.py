"""A real task learned from a headless config with a reward file: GRPO on SmolLM2-135M-Instruct
(LoRA) on reasoning-gym's chain_sum, run as a user runs it (`python -m workbench run
configs/own_task.yaml`), held-out accuracy against wall-clock.

    python bench/own_task.py [--minutes 30] [--reward rule|judge] [--out DIR] [field=value ...]

--reward rule: the config's own rewards (configs/own_task_rewards.py: the dataset's scorer on the
last number, and a format reward). --reward judge: an LLM judge as the only reward (SmolLM2
judging SmolLM2: data.judge), while held-out accuracy is still measured by the rule (the
`correct` function, evaluated beside it). Accuracy is `eval/reward/correct`: greedy answers to
the 64 held-out questions, right at full marks.

Outputs under --out (bench/results/own_task/<reward>/): the run's directory (metrics.jsonl,
rollouts.jsonl, ...), accuracy_vs_wallclock.png, result.json; the last line printed is one JSON
object: task, reward, start and final accuracy, the gain in points, seconds, iterations.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "own_task.yaml"
GOAL_POINTS = 15.0
ACCURACY = "eval/reward/correct"
RUBRIC = "Question: {prompt}\nAnswer: {response}\nIs the answer correct? Reply yes or no."
"""The judge sees the question and the answer, not the ground truth: a model grading arithmetic."""
JUDGE = (
    f"data.judge.template={json.dumps(RUBRIC)}",  # a YAML double-quoted scalar, its \n a newline
    "data.judge.verdict=yes_no",
    "data.judge.fallback=0.0",
)


def curve(metrics: list[dict]) -> list[tuple[float, float, int]]:
    """(seconds into the run, held-out accuracy, iteration) of every evaluation."""
    return [(m["run/elapsed_s"], m[ACCURACY], m["iteration"]) for m in metrics if ACCURACY in m]


def save_chart(points: list[tuple[float, float, int]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    ax.plot([p[0] / 60 for p in points], [100 * p[1] for p in points], marker="o")
    ax.set_xlabel("wall-clock (minutes, 2 CPU cores)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--reward", choices=("rule", "judge"), default="rule")
    parser.add_argument("--out", type=Path)
    parser.add_argument("overrides", nargs="*", help="more dotted.field=value overrides of the config")
    args = parser.parse_args()
    out = (args.out or ROOT / "bench" / "results" / "own_task" / args.reward).resolve()
    run_dir = out / "run"
    overrides = [f"time_limit_s={args.minutes * 60}", f"logging.output_dir={run_dir}", f"name=own_task_{args.reward}"]
    if args.reward == "judge":
        # The rule is still evaluated beside the judge (weight 0 in the score): the accuracy it measures.
        overrides += [
            *JUDGE,
            "data.rewards=[{function: configs/own_task_rewards.py:correct, weight: 0.0}]",
        ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = [sys.executable, "-m", "workbench", "run", str(CONFIG), *overrides, *args.overrides]
    print(" ".join(command), flush=True)
    subprocess.run(command, cwd=ROOT, env=env, check=True)

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    points = curve(metrics)
    start, final = points[0][1], points[-1][1]
    seconds = points[-1][0]
    trained = [m for m in metrics if "timing_s/step" in m]
    title = f"chain_sum, SmolLM2-135M-Instruct, GRPO + LoRA, reward: {args.reward}"
    save_chart(points, title, out / "accuracy_vs_wallclock.png")
    result = {
        "task": "reasoning_gym/chain_sum",
        "reward": args.reward,
        "start_accuracy": round(start, 4),
        "final_accuracy": round(final, 4),
        "gain_points": round(100 * (final - start), 1),
        "goal_points": GOAL_POINTS,
        "seconds": round(seconds, 1),
        "iterations": len(trained),
        "mean_iteration_s": round(sum(m["timing_s/step"] for m in trained) / max(1, len(trained)), 2),
        "curve": [[round(s, 1), round(a, 4), it] for s, a, it in points],
    }
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    for s, a, it in points:
        print(f"{s / 60:6.1f} min  iteration {it:4d}  held-out accuracy {100 * a:5.1f}%")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
