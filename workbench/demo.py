"""`make demo` / `python -m workbench demo`: one PPO-shaped iteration's dataflow on real models.

A tiny Llama (the built-in kit) is fine-tuned for a few seconds on arithmetic, then the single
controller drives real worker groups on a split placement: the actor (FSDP2 shards + HF
rollout + a frozen reference copy, one process per device) on one pool, the critic on
another, and an exact-match rule reward in Ray tasks. Futures flow worker to worker; the
driver fetches only the final columns. It prints a few rows, a timeline of every call, and
writes a Perfetto trace. (Updates and the algorithms come with `algorithms/`.)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from workbench import Session
from workbench.data import arithmetic
from workbench.data.prompts import tokenize_prompts
from workbench.engines.rollout import SamplingConfig
from workbench.models import load, make_tiny
from workbench.stages import SFTConfig, train_sft
from workbench.tracing import text_timeline
from workbench.workers import ActorConfig, ActorRolloutRefWorker
from workbench.workers.critic import CriticConfig, CriticWorker
from workbench.workers.rule_reward import RuleReward


def prepare_model(workdir: Path, sft_steps: int) -> Path:
    """The tiny model, fine-tuned on one-digit additions (cached between runs)."""
    sft_dir = workdir / f"sft-{sft_steps}"
    if not (sft_dir / "config.json").exists():
        torch.set_num_threads(1)
        base = make_tiny("1m", workdir / "base")
        problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), 400, seed=0)
        result = train_sft(base, arithmetic.demonstrations(problems), sft_dir, SFTConfig(steps=sft_steps, log_every=0))
        print(f"SFT: loss {result['first_loss']:.2f} -> {result['last_loss']:.2f} in {sft_steps} steps")
    return sft_dir


def run(num_prompts: int, workdir: Path, trace_path: Path, sft_steps: int = 200) -> dict:
    model_dir = prepare_model(workdir, sft_steps)
    tokenizer = load(model_dir).tokenizer
    problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), num_prompts, seed=1)
    prompts = tokenize_prompts([p.__dict__ for p in problems], tokenizer, max_prompt_length=32)

    with Session(num_devices=4) as session:
        actor = session.group(
            "actor", ActorRolloutRefWorker, session.pool("actor_pool", 2),
            ActorConfig(model_path=str(model_dir), reference=True),
        )
        critic = session.group("critic", CriticWorker, session.pool("critic_pool", 2), CriticConfig(model_path=str(model_dir)))
        reward = RuleReward(arithmetic.score)
        print(f"placement: actor+reference on {actor.pool}, critic on {critic.pool}, rule reward in Ray tasks")

        start = time.monotonic()
        generated = actor.generate_sequences(prompts, SamplingConfig(max_new_tokens=6, n=2, seed=0))
        ref = actor.compute_ref_log_prob(generated)  # same processes as the actor: runs next
        values = critic.compute_values(generated)  # other pool: overlaps with the reference pass
        scores = reward.compute_reward(generated)  # each task pulls its rows from actor ranks
        batch = generated.get().union(ref.get()).union(values.get()).union(scores.get())
        elapsed = time.monotonic() - start

        print(f"one iteration's dataflow over {num_prompts} prompts x 2 samples took {elapsed:.2f} s")
        print(f"batch: {batch}")
        for i in range(min(4, len(batch))):
            print(f"  {batch['prompt'][i]!r:>16} -> {batch['response_text'][i]!r:<8} score {batch['scores'][i]:.0f}")
        accuracy = float(batch["scores"].mean())
        print(f"exact-match accuracy of the sampled answers: {accuracy:.2f}")
        records = session.trace()
        print(text_timeline(records))
        session.save_trace(trace_path)
        print(f"trace written to {trace_path} (open it at https://ui.perfetto.dev)")
        return {"rows": len(batch), "seconds": elapsed, "calls": len(records), "accuracy": accuracy}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workbench demo", description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--workdir", type=Path, default=Path("runs/demo"))
    parser.add_argument("--trace", type=Path, default=Path("runs/demo/trace.json"))
    parser.add_argument("--sft-steps", type=int, default=200)
    args = parser.parse_args(argv)
    args.trace.parent.mkdir(parents=True, exist_ok=True)
    run(args.prompts, args.workdir, args.trace, args.sft_steps)
