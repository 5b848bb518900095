"""The cost of replay (algorithms.replay): k variants of one iteration's update, each a real update
taken on the actor and rewound, against k times that update alone, on the real model.

SmolLM2-135M-Instruct with LoRA (`--full` for full fine-tuning) on a 2-rank FSDP2 actor, GRPO on
the chat arithmetic task. One iteration makes the batch; then, alternating `--rounds` times:
the live update alone (snapshot, `update_actor`, restore: only the update is timed), and
`grpo.replay(batch, variants)` with k variants (GRPO, Dr. GRPO, GSPO, sequence-mean, a TIS cap),
whole (the driver's advantages and losses, the snapshot, k updates and rewinds, the dot
products). Goal (issue 50): replay <= k x the update + 10%. The extra over k updates is named
(`extra_s`), and replay with `kl=True` (a forward before and one per variant) is timed beside it.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from algorithms import GRPO, Groups, GRPOConfig
from workbench import ActorConfig, ActorRolloutRefWorker, LoRAConfig, OptimConfig, RuleReward, SamplingConfig, Session
from workbench.data import arithmetic, arithmetic_chat
from workbench.data.prompts import tokenize_prompts
from workbench.models import import_gguf, load_tokenizer

VARIANTS = {
    "grpo": {},
    "dr_grpo": {"estimator": "drgrpo", "loss_agg_mode": "seq-mean-token-sum-norm"},
    "gspo": {"policy_loss": "gspo"},
    "seq_mean": {"loss_agg_mode": "seq-mean-token-mean"},
    "tis_1.5": {"off_policy_correction": "tis", "is_cap": 1.5},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    args = parser.parse_args()
    torch.set_num_threads(1)

    model_dir = import_gguf("smollm2")
    tokenizer, _ = load_tokenizer(model_dir)
    problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), args.prompts, seed=3)
    rows = [{"prompt": arithmetic_chat.messages(p), "ground_truth": p.ground_truth} for p in problems]
    prompts = tokenize_prompts(rows, tokenizer, max_prompt_length=64)
    lora = None if args.full else LoRAConfig(rank=8, alpha=16)
    rows_per_update = args.prompts * args.n
    with Session(num_devices=2, threads_per_worker=args.threads) as session:
        actor = session.group(
            "actor",
            ActorRolloutRefWorker,
            session.pool("actor_pool", 2),
            ActorConfig(
                model_path=str(model_dir),
                reference=True,
                lora=lora,
                optim=OptimConfig(lr=1e-4),
                mini_batch_size=rows_per_update,
                micro_batch_size=args.micro_batch,
            ),
        )
        grpo = GRPO(
            Groups(actor=actor, reference=actor, reward=RuleReward(arithmetic_chat.score)),
            GRPOConfig(
                sampling=SamplingConfig(max_new_tokens=args.new_tokens, n=args.n, seed=0), old_log_probs="recompute"
            ),
        )
        batch, _ = grpo.step(prompts)  # warm-up, and the batch replayed
        taken = grpo.snapshot()
        update_s, replay_s, replay_kl_s = [], [], []
        for _ in range(args.rounds):
            start = time.perf_counter()
            actor.update_actor(batch, grpo.actor_loss(pi_old_from_update=False)).get()
            update_s.append(time.perf_counter() - start)
            grpo.restore(taken)
            start = time.perf_counter()
            result = grpo.replay(batch, VARIANTS)
            replay_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            with_kl = grpo.replay(batch, VARIANTS, kl=True)
            replay_kl_s.append(time.perf_counter() - start)
        grpo.drop(taken)
    k = len(VARIANTS)
    update, replay, replay_kl = (statistics.median(x) for x in (update_s, replay_s, replay_kl_s))
    print(result)
    print(with_kl.cosines())
    print(
        json.dumps(
            {
                "model": model_dir.name,
                "mode": "full" if args.full else "lora",
                "rows": rows_per_update,
                "variants": k,
                "update_s": round(update, 3),
                "replay_s": round(replay, 3),
                "ratio_to_k_updates": round(replay / (k * update), 3),
                "goal_ratio": 1.10,
                "extra_s": round(replay - k * update, 3),
                "replay_kl_s": round(replay_kl, 3),
                "kl_extra_per_variant_s": round((replay_kl - replay) / k, 3),
                "rounds": args.rounds,
                "threads": args.threads,
                "table": [{k: None if v != v else v for k, v in row.items()} for row in result.table()],  # NaN: none
                "cosines": result.cosines(),
            }
        )
    )


if __name__ == "__main__":
    main()
