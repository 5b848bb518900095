"""Each side's best learning rate at the full horizon, from several bench/real_model.py runs.

bench/real_model.py --sweep picks each side's setting (LoRA or full fine-tuning, learning rate)
from short runs. A rate that learns fastest in 5 minutes can collapse by 30 (both sides did at
LoRA lr 3e-4). This script reads the result.json of full-length runs that differ only in their
settings, picks per side the setting with the highest final accuracy (ties: the higher mean over
the curve, as the sweep does), and compares the picks point by point; it also holds the
workbench's pick against every TRL setting at every point (the stricter reading of "at or above
TRL at every point").

    PYTHONPATH=$PWD python bench/real_model_horizon.py [RUN1/result.json RUN2/result.json ...] [--out DIR]

With no runs named it reads --out's lr_*/result.json (bench/results/real_model/ by default).

Outputs: accuracy_vs_wallclock_by_lr.png under --out (every curve: the picks solid, the others
dashed), a table, and as the last line one JSON object: each side's pick, its start and final
accuracy, the seconds each pick took to reach TRL's pick's final accuracy, the goals, the curves.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from real_model import GOAL_POINTS, best, save_chart, seconds_to_reach  # bench/ is on sys.path when run as a script

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("workbench", "trl")
SAME = ("tokens", "prompts", "samples", "minutes", "every", "points_s", "kl", "lora_rank", "eval_size", "threads")
"""Settings every run must share: only the per-side setting may differ."""


def load(paths: list[Path]) -> dict[str, list[dict]]:
    runs = [json.loads(p.read_text()) for p in paths]
    first = runs[0]["settings"]
    for path, run in zip(paths, runs):
        differ = [k for k in SAME if run["settings"].get(k) != first.get(k)]
        if differ:
            raise SystemExit(f"{path}: settings {differ} differ from {paths[0]}'s; compare runs of one design only")
    sides: dict[str, list[dict]] = {side: [] for side in SIDES}
    for path, run in zip(paths, runs):
        for side in SIDES:
            if side not in run["sides"]:  # a run of one side (bench/real_model.py --sides)
                continue
            entry = run["sides"][side]
            if any(e["setting"] == entry["setting"] for e in sides[side]):
                raise SystemExit(f"{path}: {side} setting {entry['setting']} appears in two runs; give one of each")
            sides[side].append({**entry, "run": str(path)})
    missing = [side for side in SIDES if not sides[side]]
    if missing:
        raise SystemExit(f"no run has a {missing[0]} side; give at least one run of each side")
    return sides


def plot(sides: dict[str, list[dict]], picks: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.4))
    colours = {"workbench": "tab:blue", "trl": "tab:orange"}
    names = {"workbench": "workbench", "trl": "TRL 1.16 GRPOTrainer"}
    for side in SIDES:
        for entry in sorted(sides[side], key=lambda e: e["setting"]):
            picked = entry is picks[side]
            ax.plot(
                [p["seconds"] for p in entry["curve"]],
                [100 * p["acc"] for p in entry["curve"]],
                "o-" if picked else "o--",
                color=colours[side],
                alpha=1.0 if picked else 0.45,
                label=f"{names[side]} {entry['setting']}" + (" (best at 30 min)" if picked else ""),
            )
    title = "GRPO on SmolLM2-135M-Instruct: each side at each learning rate"
    save_chart(fig, ax, picks["workbench"]["curve"][0]["acc"], path, title, legend_size=7)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "results",
        type=Path,
        nargs="*",
        help="result.json files of bench/real_model.py runs (default: --out's lr_*/result.json)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "real_model")
    args = parser.parse_args()
    args.results = args.results or sorted(args.out.glob("lr_*/result.json"))
    if not args.results:
        raise SystemExit(f"no runs given and none under {args.out}/lr_*/: run bench/real_model.py first")
    sides = load(args.results)
    picks = {side: best(sides[side]) for side in SIDES}
    ours, theirs = picks["workbench"]["curve"], picks["trl"]["curve"]
    n = min(len(e["curve"]) for side in SIDES for e in sides[side])
    trl_best_here = [max(e["curve"][i]["acc"] for e in sides["trl"]) for i in range(n)]

    header = f"{'point':>5} {'s':>6} " + " ".join(
        f"{side[:2]} {e['setting']:>10}" for side in SIDES for e in sides[side]
    )
    print(header)
    for i in range(n):
        cells = " ".join(f"{e['curve'][i]['acc']:>13.3f}" for side in SIDES for e in sides[side])
        print(f"{i:>5} {ours[i]['seconds']:>6.0f} {cells}")
    target = theirs[-1]["acc"]
    goals = {
        "workbench_gain_ge_20": 100 * (ours[-1]["acc"] - ours[0]["acc"]) >= GOAL_POINTS,
        "workbench_at_or_above_trl_everywhere": all(ours[i]["acc"] >= theirs[i]["acc"] for i in range(n)),
        "workbench_at_or_above_every_trl_setting_everywhere": all(ours[i]["acc"] >= trl_best_here[i] for i in range(n)),
    }
    print(
        f"picks at the full horizon: workbench {picks['workbench']['setting']}, TRL {picks['trl']['setting']}; "
        f"goals: {goals}"
    )
    png = args.out / "accuracy_vs_wallclock_by_lr.png"
    plot(sides, picks, png)
    print(f"chart: {png}")
    line = {
        "bench": "real_model_horizon",
        "workbench_setting": picks["workbench"]["setting"],
        "trl_setting": picks["trl"]["setting"],
        **{f"{side}_start_acc": picks[side]["curve"][0]["acc"] for side in SIDES},
        **{f"{side}_final_acc": picks[side]["curve"][-1]["acc"] for side in SIDES},
        **{f"{side}_seconds_to_trl_final": seconds_to_reach(picks[side]["curve"], target) for side in SIDES},
        "goals": goals,
        "curves": {
            side: {e["setting"]: [e["curve"][i]["acc"] for i in range(n)] for e in sides[side]} for side in SIDES
        },
        "points_s": [round(p["seconds"], 1) for p in ours[:n]],
        "runs": [str(p) for p in args.results],
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
