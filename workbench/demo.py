"""`make demo` / `python -m workbench demo`: PPO on real worker groups, end to end.

A tiny Llama (the built-in kit) is fine-tuned for a few seconds on arithmetic, then the single
controller drives real worker groups on a split placement: the actor (FSDP2 shards + HF
rollout + a frozen reference copy, one process per device) on one pool, the critic on
another, and an exact-match rule reward in Ray tasks. `algorithms.PPO` runs a few iterations
(futures flow worker to worker; the driver computes advantages), printing metrics per
iteration and held-out accuracy before and after, then a timeline of the last iteration's
calls, and writes a Perfetto trace.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from algorithms import PPO, Groups, PPOConfig
from algorithms.metrics import format_line
from workbench.data import arithmetic
from workbench.data.prompts import tokenize_prompts
from workbench.engines.contract import OptimConfig
from workbench.engines.rollout import SamplingConfig
from workbench.models import load
from workbench.session import Session
from workbench.stages.arithmetic_policy import arithmetic_policy
from workbench.tracing import text_timeline
from workbench.workers import ActorConfig, ActorRolloutRefWorker
from workbench.workers.critic import CriticConfig, CriticWorker
from workbench.workers.rule_reward import RuleReward


def run(num_prompts: int, workdir: Path, trace_path: Path, sft_steps: int = 200, iterations: int = 4) -> dict:
    model_dir = arithmetic_policy(workdir, sft_steps=sft_steps)
    tokenizer = load(model_dir).tokenizer
    task = arithmetic.ArithmeticConfig(digits=1)
    train = tokenize_prompts([p.__dict__ for p in arithmetic.generate(task, num_prompts, seed=1)], tokenizer, 32)
    held_out = tokenize_prompts([p.__dict__ for p in arithmetic.generate(task, 32, seed=2)], tokenizer, 32)

    sampling = SamplingConfig(max_new_tokens=6, n=2, seed=0)
    rows = num_prompts * sampling.n  # one optimizer step per iteration, whatever the prompt count
    with Session(num_devices=4) as session:
        actor = session.group(
            "actor",
            ActorRolloutRefWorker,
            session.pool("actor_pool", 2),
            ActorConfig(model_path=str(model_dir), reference=True, optim=OptimConfig(lr=2e-5), mini_batch_size=rows),
        )
        critic = session.group(
            "critic",
            CriticWorker,
            session.pool("critic_pool", 2),
            CriticConfig(model_path=str(model_dir), mini_batch_size=rows),
        )
        ppo = PPO(
            Groups(actor=actor, reference=actor, critic=critic, reward=RuleReward(arithmetic.score)),
            PPOConfig(sampling=sampling),
        )
        print(
            f"placement: actor+reference on {actor.pool}, critic on {critic.pool}, "
            f"rule reward in long-lived scoring processes"
        )

        before = ppo.evaluate(held_out)
        print(f"held-out exact-match accuracy (greedy) before PPO: {before:.2f}")
        for _ in range(iterations):
            batch, metrics = ppo.step(train)
            print(format_line(ppo.iteration, metrics, PPO.log_keys))
        after = ppo.evaluate(held_out)
        print(f"held-out exact-match accuracy (greedy) after {iterations} PPO iterations: {after:.2f}")

        print(f"last batch: {batch}")
        for i in range(min(4, len(batch))):
            print(f"  {batch['prompt'][i]!r:>16} -> {batch['response_text'][i]!r:<8} score {batch['scores'][i]:.0f}")
        records = session.trace()
        last = [r for r in records if r.start >= records[-1].start - metrics["timing_s/step"] - 0.5]
        print(text_timeline(last))
        session.save_trace(trace_path)
        print(f"trace written to {trace_path} (open it at https://ui.perfetto.dev)")
        return {"rows": len(batch), "calls": len(records), "accuracy_before": before, "accuracy_after": after}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workbench demo", description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--workdir", type=Path, default=Path("runs/demo"))
    parser.add_argument("--trace", type=Path, default=Path("runs/demo/trace.json"))
    parser.add_argument("--sft-steps", type=int, default=200)
    parser.add_argument("--iterations", type=int, default=4)
    args = parser.parse_args(argv)
    args.trace.parent.mkdir(parents=True, exist_ok=True)
    run(args.prompts, args.workdir, args.trace, args.sft_steps, args.iterations)
