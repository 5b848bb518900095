"""Rollout throughput of the actor's `generate_sequences` vs the bare engine, and the hybrid
engine's weight-sync cost as a fraction of one PPO-shaped iteration. All in one run.

- tokens/s: a 1-rank actor group (so the comparison is one process against one process, both
  with one torch thread) generating 64 prompts x 64 new tokens on the ~10M tiny model, vs the
  same engine called directly in this process on the same prompts. Goal: ratio >= 0.9.
- sync fraction: one iteration = generate (which first syncs the updated weights into the
  rollout copy) + old/ref log-probs + an actor update; the `hybrid.sync_weights` span from
  the trace over the iteration's wall time. Goal: <= 5%.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from workbench import Batch, Session
from workbench.data import arithmetic
from workbench.data.prompts import tokenize_prompts
from workbench.engines.forward import response_log_probs
from workbench.engines.fsdp import OptimConfig
from workbench.engines.hf_rollout import HFRollout
from workbench.engines.rollout import SamplingConfig
from workbench.models import load, make_tiny
from workbench.workers import ActorConfig, ActorRolloutRefWorker

CACHE = Path(__file__).resolve().parents[1] / ".cache" / "bench"


def reinforce_loss(model, batch):
    log_probs, _ = response_log_probs(model, batch)
    loss = -(batch["advantages"] * (log_probs * batch["response_mask"]).sum(1)).mean()
    return loss, {"loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="10m")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    model_dir = make_tiny(args.size, CACHE / f"tiny-{args.size}")
    loaded = load(model_dir)
    problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=2), args.prompts, seed=0)
    prompts = tokenize_prompts([p.__dict__ for p in problems], loaded.tokenizer, max_prompt_length=32)
    # min_new_tokens is not part of the contract: count the tokens actually generated.
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, seed=0)
    bare = HFRollout(loaded.model, loaded.tokenizer.pad_token_id, loaded.tokenizer.eos_token_id)

    with Session(num_devices=2) as session:
        config = ActorConfig(model_path=str(model_dir), reference=True, optim=OptimConfig(lr=1e-5),
                             mini_batch_size=args.prompts, micro_batch_size=16)
        actor = session.group("actor", ActorRolloutRefWorker, session.pool("actor", 1), config)
        actor.generate_sequences(prompts[:2], sampling).get()  # warm-up both paths
        bare.generate(prompts[:2], sampling)

        ours, theirs = [], []
        for _ in range(args.repeats):  # alternate so both see the same machine load
            start = time.perf_counter()
            out = actor.generate_sequences(prompts, sampling).get()
            ours.append(int(out["response_mask"].sum()) / (time.perf_counter() - start))
            start = time.perf_counter()
            ref = bare.generate(prompts, sampling)
            theirs.append(int(ref["response_mask"].sum()) / (time.perf_counter() - start))

        # One PPO-shaped iteration after an update, so generation starts with a weight sync.
        batch = out.union(Batch({"advantages": torch.randn(len(out))}))
        actor.update_actor(batch, reinforce_loss).get()
        session.trace()  # drop earlier spans
        start = time.time()
        generated = actor.generate_sequences(prompts, sampling)
        old, ref_lp = actor.compute_log_prob(generated), actor.compute_ref_log_prob(generated)
        rows = generated.get().union(old.get()).union(ref_lp.get())
        actor.update_actor(rows.union(Batch({"advantages": torch.randn(len(rows))})), reinforce_loss).get()
        iteration = time.time() - start
        sync = sum(r.seconds for r in session.trace() if r.method == "hybrid.sync_weights")

    result = {
        "bench": "rollout",
        "backend": "hf",
        "model": args.size,
        "params": sum(p.numel() for p in loaded.model.parameters()),
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "tokens_per_s": round(statistics.median(ours), 1),
        "bare_tokens_per_s": round(statistics.median(theirs), 1),
        "ratio": round(statistics.median(ours) / statistics.median(theirs), 3),
        "sync_s": round(sync, 4),
        "iteration_s": round(iteration, 3),
        "sync_fraction": round(sync / iteration, 4),
        "goal_ratio": 0.9,
        "goal_sync_fraction": 0.05,
    }
    print(f"generate_sequences (HF, 1 rank): {result['tokens_per_s']} tok/s vs bare HF generate "
          f"{result['bare_tokens_per_s']} tok/s -> x{result['ratio']}")
    print(f"weight sync {result['sync_s']} s of a {result['iteration_s']} s iteration -> {result['sync_fraction']:.2%}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
