"""The README's figure, drawn from recorded results only (nothing is run or estimated here).

Left: GRPO on SmolLM2-135M-Instruct (LoRA, 2 CPU cores), held-out accuracy against wall-clock,
the workbench at its best learning rate over 30 minutes against TRL's `GRPOTrainer` at each rate
tried (bench/results/real_model/: bench/real_model.py's runs). Right: a task of one's own learned
from a headless config with a rule reward (bench/results/own_task/rule/: bench/own_task.py).

    python bench/figures.py [--out docs/images/results.png]

Its last line is one JSON object: the figure's path and the numbers it drew.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT / "bench" / "results" / "real_model"
OWN = ROOT / "bench" / "results" / "own_task" / "rule" / "result.json"
OUT = ROOT / "docs" / "images" / "results.png"


def side(path: Path, name: str) -> tuple[str, list[tuple[float, float]]]:
    """(setting, [(minutes, accuracy %)]) of one side of a bench/real_model.py result."""
    run = json.loads(path.read_text())["sides"][name]
    return run["setting"], [(p["seconds"] / 60, 100 * p["acc"]) for p in run["curve"]]


def curves() -> dict:
    # The workbench's pick (lr 2e-4) and TRL at its three rates: bench/results/real_model/README.md
    # says why these runs (the horizon pick; the 5-minute sweep's 3e-4 collapses late).
    workbench = side(REAL / "lr_2e-4" / "result.json", "workbench")
    trl = [
        side(REAL / "lr_1e-4_trl" / "result.json", "trl"),
        side(REAL / "lr_2e-4" / "result.json", "trl"),
        side(REAL / "lr_3e-4" / "result.json", "trl"),
    ]
    own = json.loads(OWN.read_text())
    return {
        "workbench": workbench,
        "trl": trl,
        "own_task": (own["task"], [(s / 60, 100 * acc) for s, acc, _ in own["curve"]]),
    }


def label(setting: str) -> str:
    kind, _, lr = setting.partition("@")  # "lora@0.0002"
    return f"{'LoRA' if kind == 'lora' else kind}, lr {float(lr):.0e}"


def draw(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4), dpi=100, gridspec_kw={"width_ratios": [3, 2]})
    setting, points = data["workbench"]
    left.plot(*zip(*points), marker="o", color="C0", lw=2.2, label=f"workbench, {label(setting)}")
    for (setting, points), shade in zip(data["trl"], ("C3", "C1", "0.6")):
        left.plot(*zip(*points), marker=".", color=shade, lw=1.2, label=f"TRL, {label(setting)}")
    left.set_title("GRPO on SmolLM2-135M-Instruct vs TRL (two-digit sums)", fontsize=10)
    left.set_ylabel("held-out accuracy (%)")
    left.legend(fontsize=8, loc="lower right")

    task, points = data["own_task"]
    right.plot(*zip(*points), marker="o", color="C2", lw=2)
    right.set_title(f"own task, rule reward ({task.split('/')[-1]}, SmolLM2)", fontsize=10)
    for ax in (left, right):
        ax.set_xlabel("training wall-clock (minutes, 2 CPU cores)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    data = curves()
    draw(data, args.out)
    print(json.dumps({"bench": "figures", "figure": str(args.out.relative_to(ROOT)), "curves": data}))


if __name__ == "__main__":
    main()
