"""LoRA vs full fine-tuning of the actor: peak memory per actor process, and the adapter sync's
share of an iteration. All in one run, on the tiny kit's 30M model.

- memory: a 1-rank actor (FSDP2, HF rollout, reference policy) runs PPO-shaped iterations
  (generate, old and reference log-probs, update); its process's peak RSS (VmHWM) for LoRA vs
  full fine-tuning, also net of a bare worker process with the same imports and no model.
  Goal (issue 23): LoRA <= half of full fine-tuning.
- sync fraction: a 2-rank FSDP2 actor, whose HF rollout holds its own generation copy, so every
  generation after an update first syncs weights: the `hybrid.sync_weights` span over the
  iteration's wall time, LoRA (adapters only) and full (every weight). Goal: LoRA <= 2%.

`--model DIR` runs it on a real model directory (e.g. SmolLM2-135M-Instruct) with the chat
arithmetic task (workbench.data.arithmetic_chat); the issue's scale is
`--model DIR --prompts 8 --n 4 --new-tokens 16 --threads 2 --micro-batch 8`. Peak RSS is also
read after each step of the first (warm-up) iteration (`steps`: worker start, generate, the two
log-prob forwards, the update), which says what sets the peak.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from workbench import Batch, Session
from workbench.controller import ONE_TO_ALL, Worker, register
from workbench.data import arithmetic, arithmetic_chat
from workbench.data.prompts import tokenize_prompts
from workbench.engines.contract import OptimConfig
from workbench.engines.rollout import SamplingConfig
from workbench.models import load, make_tiny
from workbench.models.load import LoadConfig
from workbench.models.lora import LoRAConfig
from workbench.workers import ActorConfig, ActorRolloutRefWorker

CACHE = Path(__file__).resolve().parents[1] / ".cache" / "bench"
MIB = 2**20


def reinforce_loss(outputs, batch):
    log_probs = outputs["log_probs"]
    loss = -(batch["advantages"] * (log_probs * batch["response_mask"]).sum(1)).mean()
    return loss, {"loss": loss.item()}


class BareWorker(Worker):
    """A worker process with the actor's imports and no model: the baseline of an actor's RSS."""

    def __init__(self, config=None):
        super().__init__(config)
        import peft  # noqa: F401

        import workbench.workers.actor  # noqa: F401

    @register(ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()


def proc_status(pid: int, key: str) -> int:
    """A /proc/<pid>/status memory line in bytes (VmHWM: peak RSS; VmRSS: now). Same machine."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def iteration(actor, prompts, sampling, peaks: dict | None = None, pid: int = 0) -> float:
    """One PPO-shaped iteration; with `peaks`, rank 0's peak RSS (MiB) after each of its steps
    (each waited for before the next is sent)."""

    def step(name, future):
        rows = future.get()
        if peaks is not None:
            peaks[name] = round(proc_status(pid, "VmHWM") / MIB, 1)
        return rows

    start = time.time()
    generated = step("generate", actor.generate_sequences(prompts, sampling))
    rows = generated.union(step("old_log_prob", actor.compute_log_prob(generated)))
    rows = rows.union(step("ref_log_prob", actor.compute_ref_log_prob(generated)))
    step("update", actor.update_actor(rows.union(Batch({"advantages": torch.randn(len(rows))})), reinforce_loss))
    return time.time() - start


def run(session, name, model_dir, prompts, sampling, lora, ranks, iterations, load_config, micro_batch) -> dict:
    config = ActorConfig(
        model_path=str(model_dir),
        reference=True,
        optim=OptimConfig(lr=1e-4),
        mini_batch_size=len(prompts) * sampling.n,  # one optimizer step per iteration
        micro_batch_size=micro_batch,
        lora=lora,
        load=load_config,
    )
    actor = session.group(name, ActorRolloutRefWorker, session.pool(f"pool_{name}", ranks), config)
    pid = actor.hostset.where(0)[0]
    steps = {"start": round(proc_status(pid, "VmHWM") / MIB, 1)}
    iteration(actor, prompts, sampling, steps, pid)  # warm-up: the first update makes Adam's states
    session.trace()  # drop earlier spans
    seconds = [iteration(actor, prompts, sampling) for _ in range(iterations)]
    records = [r for r in session.trace() if r.role == actor.role]
    syncs = [r for r in records if r.method == "hybrid.sync_weights" and r.rank == 0]
    result = {
        "peak_rss_mib": round(proc_status(pid, "VmHWM") / MIB, 1),
        "peak_rss_after_mib": steps,
        "iteration_s": round(sum(seconds) / len(seconds), 3),
        "sync_s": round(sum(r.seconds for r in syncs) / max(1, len(syncs)), 4),
        "sync_mib": round(syncs[-1].extra["bytes_loaded"] / MIB, 3) if syncs else 0.0,
    }
    result["sync_fraction"] = round(result["sync_s"] / result["iteration_s"], 4)
    session.clear()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="30m")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--modes", default="full,lora", help="which of full,lora to measure memory of (1 rank)")
    parser.add_argument(
        "--sync-modes", default=None, help="which of full,lora to time syncs of (2 ranks; default --modes)"
    )
    parser.add_argument("--model", default=None, help="a model directory (default: the tiny kit's --size)")
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per forward/backward")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="LoadConfig.gradient_checkpointing")
    args = parser.parse_args()
    torch.set_num_threads(1)

    if args.model:  # a real chat model: the chat arithmetic task, rendered with its template
        model_dir = Path(args.model).expanduser()
        loaded = load(model_dir)
        problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), args.prompts, seed=0)
        rows = [{"prompt": arithmetic_chat.messages(p), "ground_truth": p.ground_truth} for p in problems]
        prompts = tokenize_prompts(rows, loaded.tokenizer, max_prompt_length=64)
    else:
        model_dir = make_tiny(args.size, CACHE / f"tiny-{args.size}")
        loaded = load(model_dir)
        problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=2), args.prompts, seed=0)
        prompts = tokenize_prompts([p.__dict__ for p in problems], loaded.tokenizer, max_prompt_length=32)
    sampling = SamplingConfig(max_new_tokens=args.new_tokens, n=args.n, seed=0)
    lora = LoRAConfig(rank=args.rank, alpha=2.0 * args.rank)
    load_config = LoadConfig(gradient_checkpointing=args.gradient_checkpointing)

    def measure(name: str, mode: str, ranks: int) -> dict:
        adapters = lora if mode == "lora" else None
        return run(
            session, name, model_dir, prompts, sampling, adapters, ranks, args.iterations, load_config, args.micro_batch
        )

    with Session(num_devices=2, threads_per_worker=args.threads) as session:
        bare = session.group("bare", BareWorker, session.pool("bare_pool", 1))
        baseline = proc_status(bare.pid().get()[0], "VmHWM") / MIB
        session.clear()
        wanted = [m for m in ("full", "lora") if m in args.modes.split(",")]
        synced = [m for m in ("full", "lora") if m in (args.sync_modes or args.modes).split(",")]
        memory = {m: measure(f"mem_{m}", m, 1) for m in wanted}
        sync = {m: measure(f"sync_{m}", m, 2) for m in synced}
    full, ours = memory.get("full", {}).get("peak_rss_mib"), memory.get("lora", {}).get("peak_rss_mib")
    ratio = net = None
    if full and ours:
        ratio, net = round(ours / full, 3), round((ours - baseline) / (full - baseline), 3)
        print(
            f"peak RSS per actor process: full {full} MiB, LoRA r={args.rank} {ours} MiB (x{ratio}); "
            f"net of a bare worker ({baseline:.0f} MiB): x{net}"
        )
    for mode, r in sync.items():
        print(
            f"[{mode}] 2 ranks: sync {r['sync_s']} s ({r['sync_mib']} MiB) of a {r['iteration_s']} s "
            f"iteration ({r['sync_fraction']:.2%})"
        )
    print(
        json.dumps(
            {
                "bench": "lora",
                "model": str(args.model) if args.model else args.size,
                "params": sum(p.numel() for p in loaded.model.parameters()),
                "lora_rank": args.rank,
                "baseline_rss_mib": round(baseline, 1),
                "memory": memory,
                "sync": sync,
                "memory_ratio": ratio,
                "memory_ratio_net": net,
                "lora_sync_fraction": sync.get("lora", {}).get("sync_fraction"),
                "shape": {
                    "prompts": args.prompts,
                    "n": args.n,
                    "new_tokens": args.new_tokens,
                    "micro_batch": args.micro_batch,
                    "threads": args.threads,
                    "gradient_checkpointing": args.gradient_checkpointing,
                },
                "goal_memory_ratio": 0.5,
                "goal_sync_fraction": 0.02,
            }
        )
    )


if __name__ == "__main__":
    main()
