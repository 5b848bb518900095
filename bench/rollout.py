"""Rollout throughput of the actor's `generate_sequences` vs the bare engine, and the hybrid
engine's weight-sync cost as a fraction of one PPO-shaped iteration. All in one run.

- tokens/s: a 1-rank actor group (one process against one process, both on one core)
  generating 64 prompts x 64 new tokens on the ~10M tiny model, vs the same engine (HF
  `generate`; vLLM's `llm.generate` with the same requests) called directly in this process.
  Goal: ratio >= 0.9, for each backend.
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
from workbench.engines.contract import OptimConfig
from workbench.engines.hf_rollout import HFRollout
from workbench.engines.rollout import SamplingConfig
from workbench.models import load, make_tiny
from workbench.workers import ActorConfig, ActorRolloutRefWorker

CACHE = Path(__file__).resolve().parents[1] / ".cache" / "bench"


def reinforce_loss(outputs, batch):
    log_probs = outputs["log_probs"]
    loss = -(batch["advantages"] * (log_probs * batch["response_mask"]).sum(1)).mean()
    return loss, {"loss": loss.item()}


def bare_engine(backend: str, model_dir, loaded):
    """The engine itself in this process, and a function generating with it directly."""
    if backend == "hf":
        engine = HFRollout(loaded.model, loaded.tokenizer.pad_token_id, loaded.tokenizer.eos_token_id)
        return lambda prompts, sampling: int(engine.generate(prompts, sampling)["response_mask"].sum())
    from vllm.inputs import TokensPrompt

    from workbench.engines.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    engine = VLLMRollout(model_dir, VLLMRolloutConfig(max_model_len=256, cpu_threads_bind="0"))

    def generate(prompts, sampling):  # llm.generate with the very requests the worker sends
        # The worker's engine drops its prefix cache after every generation (release()), and
        # RL never sends the same prompts twice: don't let the bare engine reuse cached KV.
        engine.llm.reset_prefix_cache()
        tokens = engine._prompt_tokens(prompts, sampling.max_new_tokens)
        params = [engine._sampling_params(sampling, i) for i in range(len(tokens))]
        outs = engine.llm.generate([TokensPrompt(prompt_token_ids=t) for t in tokens], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return generate


def measure(session, backend: str, model_dir, loaded, prompts, sampling, repeats: int) -> dict:
    config = ActorConfig(
        model_path=str(model_dir),
        rollout=backend,
        reference=True,
        optim=OptimConfig(lr=1e-5),
        mini_batch_size=len(prompts),
        micro_batch_size=16,
    )
    actor = session.group(f"actor_{backend}", ActorRolloutRefWorker, session.pool(f"pool_{backend}", 1), config)
    bare = bare_engine(backend, model_dir, loaded)
    actor.generate_sequences(prompts[:2], sampling).get()  # warm-up both paths
    bare(prompts[:2], sampling)
    ours, theirs = [], []
    for _ in range(repeats):  # alternate so both see the same machine load
        start = time.perf_counter()
        out = actor.generate_sequences(prompts, sampling).get()
        ours.append(int(out["response_mask"].sum()) / (time.perf_counter() - start))
        start = time.perf_counter()
        theirs.append(bare(prompts, sampling) / (time.perf_counter() - start))

    # One PPO-shaped iteration after an update, so generation starts with a weight sync.
    actor.update_actor(out.union(Batch({"advantages": torch.randn(len(out))})), reinforce_loss).get()
    session.trace()  # drop earlier spans
    start = time.time()
    generated = actor.generate_sequences(prompts, sampling)
    old, ref_lp = actor.compute_log_prob(generated), actor.compute_ref_log_prob(generated)
    rows = generated.get().union(old.get()).union(ref_lp.get())
    actor.update_actor(rows.union(Batch({"advantages": torch.randn(len(rows))})), reinforce_loss).get()
    iteration = time.time() - start
    sync = sum(r.seconds for r in session.trace() if r.method == "hybrid.sync_weights" and r.role == actor.role)
    session.clear()
    result = {
        "tokens_per_s": round(statistics.median(ours), 1),
        "bare_tokens_per_s": round(statistics.median(theirs), 1),
        "ratio": round(statistics.median(ours) / statistics.median(theirs), 3),
        "sync_s": round(sync, 4),
        "iteration_s": round(iteration, 3),
        "sync_fraction": round(sync / iteration, 4),
    }
    print(
        f"[{backend}] generate_sequences (1 rank): {result['tokens_per_s']} tok/s vs bare engine "
        f"{result['bare_tokens_per_s']} tok/s -> x{result['ratio']}; weight sync {result['sync_s']} s "
        f"of a {result['iteration_s']} s iteration ({result['sync_fraction']:.2%})"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="10m")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", default="hf,vllm")
    args = parser.parse_args()
    torch.set_num_threads(1)

    model_dir = make_tiny(args.size, CACHE / f"tiny-{args.size}")
    loaded = load(model_dir)
    problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=2), args.prompts, seed=0)
    prompts = tokenize_prompts([p.__dict__ for p in problems], loaded.tokenizer, max_prompt_length=32)
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, seed=0)
    backends = args.backends.split(",")
    with Session(num_devices=2) as session:
        results = {b: measure(session, b, model_dir, loaded, prompts, sampling, args.repeats) for b in backends}
    print(
        json.dumps(
            {
                "bench": "rollout",
                "model": args.size,
                "params": sum(p.numel() for p in loaded.model.parameters()),
                "prompts": args.prompts,
                "new_tokens": args.new_tokens,
                **results,
                "ratio_min": min(r["ratio"] for r in results.values()),
                "sync_fraction_max": max(r["sync_fraction"] for r in results.values()),
                "goal_ratio": 0.9,
                "goal_sync_fraction": 0.05,
            }
        )
    )


if __name__ == "__main__":
    main()
