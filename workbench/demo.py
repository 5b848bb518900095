"""`make demo` / `python -m workbench demo`: the single controller driving a PPO-shaped dataflow.

Until the model workers land, the models here are toy numeric workers (a random policy over a
tiny vocabulary, a critic and a reward that are a few tensor ops), but everything around them
is the real runtime: an embedded Ray, placement groups, gloo process groups, futures flowing
worker to worker, time-sharing on a colocated pool and overlap across split pools, and a
Perfetto trace of every call.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist

from workbench import DP_PROTO, ONE_TO_ALL, Batch, Mesh, Session, Worker, register
from workbench.tracing import text_timeline


class ToyPolicy(Worker):
    """Samples 'responses' from a random policy; stands in for the actor until real models."""

    @register(DP_PROTO)
    def generate_sequences(self, prompts: Batch) -> Batch:
        g = torch.Generator().manual_seed(1000 + self.rank)
        responses = torch.randint(0, 32, (len(prompts), 16), generator=g)
        time.sleep(0.3)  # stands in for decoding time
        out = prompts.union(Batch({"responses": responses}))
        out["old_log_probs"] = torch.full(responses.shape, -3.47)
        return out


class ToyCritic(Worker):
    @register(DP_PROTO)
    def compute_values(self, batch: Batch) -> Batch:
        time.sleep(0.3)
        values = batch["responses"].float().mean(dim=1, keepdim=True).expand(-1, 16) / 32
        return Batch({"values": values.contiguous()})

    @register(ONE_TO_ALL)
    def sync_check(self) -> float:
        """An all-reduce over the critic's process group (what a DP gradient sync does)."""
        x = torch.ones(1) * (self.rank + 1)
        dist.all_reduce(x)
        return x.item()


class ToyReward(Worker):
    @register(DP_PROTO)
    def compute_reward(self, batch: Batch) -> Batch:
        time.sleep(0.3)
        return Batch({"scores": (batch["responses"] % 2 == 0).float().mean(dim=1)})


def run(num_prompts: int, trace_path: Path) -> dict:
    with Session(num_devices=4) as session:
        actor_pool = session.pool("actor_pool", 2)
        critic_pool = session.pool("critic_pool", 2)
        actor = session.group("actor", ToyPolicy, actor_pool)
        critic = session.group("critic", ToyCritic, critic_pool, mesh=Mesh(dp=2))
        reward = session.group("reward", ToyReward, critic_pool)  # colocated with the critic
        print(f"pools: {actor_pool}, {critic_pool}")
        print(f"critic all-reduce over its 2 ranks: {critic.sync_check().get()}")

        prompts = Batch(
            {"input_ids": torch.arange(num_prompts * 8).view(num_prompts, 8)},
            {"prompt": [f"Q: {i}+{i}=? A:" for i in range(num_prompts)]},
        )
        start = time.monotonic()
        generated = actor.generate_sequences(prompts)  # a future; nothing fetched yet
        values = critic.compute_values(generated)  # critic ranks pull their rows from the actor
        scores = reward.compute_reward(generated)  # same pool as the critic: runs after it
        batch = generated.get().union(values.get()).union(scores.get())
        elapsed = time.monotonic() - start
        print(f"one iteration's dataflow over {len(batch)} prompts took {elapsed:.2f} s")
        print(f"batch: {batch}")
        for row in batch.table(max_rows=3):
            print("  ", {k: row[k] for k in ("prompt", "scores")})
        records = session.trace()
        print(text_timeline(records))
        session.save_trace(trace_path)
        print(f"trace written to {trace_path} (open it at https://ui.perfetto.dev)")
        return {"rows": len(batch), "seconds": elapsed, "calls": len(records)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workbench demo", description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--trace", type=Path, default=Path("runs/demo_trace.json"))
    args = parser.parse_args(argv)
    args.trace.parent.mkdir(parents=True, exist_ok=True)
    run(args.prompts, args.trace)
