"""PPO twice with the same seeds on a NetnsCluster (called by netns_check's driver on host 0,
on its session): once spread over the hosts (the actor's two data-parallel ranks one per host,
the critic on host 0, the reward model on host 1) and once with every group on host 1. The
models and exports live in a directory every host sees. Returns what each run placed where, its
metrics, its exported weights compared and the trace's bytes per host; test_netns_cluster.py
asserts on it.
"""

import time
from pathlib import Path

import ray
import torch
from safetensors.torch import load_file

from algorithms import PPO, Groups, PPOConfig
from workbench import Session
from workbench.data import arithmetic
from workbench.data.prompts import PromptLoader, PromptLoaderConfig
from workbench.engines.contract import OptimConfig
from workbench.engines.rollout import SamplingConfig
from workbench.models import load, make_tiny
from workbench.run.checkpoint import RunCheckpointer
from workbench.workers import ActorConfig, ActorRolloutRefWorker
from workbench.workers.critic import CriticConfig, CriticWorker
from workbench.workers.reward import RewardModelWorker, ScoreModelConfig

ITERATIONS = 2


def ppo_run(session: Session, shared: Path, name: str, layout: dict[str, tuple]) -> dict:
    """Two PPO iterations with each role's pool as `layout` says (role -> (devices, hosts)); what they gave."""
    started = time.time()
    policy, scorer = str(shared / "policy"), str(shared / "scorer")
    optim = OptimConfig(lr=1e-3)

    def pool(role: str):
        devices, hosts = layout[role]
        return session.pool(f"{role}_pool", devices, hosts=hosts)

    actor = session.group(
        "actor",
        ActorRolloutRefWorker,
        pool("actor"),
        ActorConfig(model_path=policy, reference=True, optim=optim, mini_batch_size=4, micro_batch_size=2),
    )
    critic = session.group(
        "critic", CriticWorker, pool("critic"), CriticConfig(model_path=policy, optim=optim, mini_batch_size=4)
    )
    reward = session.group("reward", RewardModelWorker, pool("reward"), ScoreModelConfig(model_path=scorer))
    ppo = PPO(
        Groups(actor=actor, reference=actor, critic=critic, reward=reward),
        PPOConfig(sampling=SamplingConfig(max_new_tokens=5, n=2, seed=11), kl_coef=0.05),
    )
    tokenizer = load(policy).tokenizer
    rows = [p.__dict__ for p in arithmetic.generate(arithmetic.ArithmeticConfig(digits=1), 12, seed=2)]
    batches = PromptLoader(rows, tokenizer, PromptLoaderConfig(batch_size=4, max_prompt_length=32, seed=3)).batches(0)
    metrics = []
    for _ in range(ITERATIONS):
        _, row = ppo.step(next(batches))
        metrics.append({k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/"))})
    exported = RunCheckpointer(shared / f"ckpt-{name}").export_hf(ppo, shared / f"hf-{name}")
    records = [r for r in session.trace() if r.start >= started]  # the session keeps earlier runs' too
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    placed = {role: [address[n] for n in group.pool.node_ids] for role, group in session.groups.items()}
    bytes_in: dict[str, dict[str, int]] = {}
    for r in records:
        per_host = bytes_in.setdefault(r.role, {})
        per_host[r.node] = per_host.get(r.node, 0) + r.bytes_in
    session.clear()
    return {
        "placed": placed,
        "metrics": metrics,
        "exported": {k: str(v) for k, v in exported.items()},
        "bytes_in": bytes_in,
    }


def weights(directory: str) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(Path(directory).glob("*.safetensors")) for k, v in load_file(f).items()}


def compare(session: Session, shared: Path, ip0: str, ip1: str) -> dict:
    """The spread run and the one-host run, and whether their exported weights are equal."""
    make_tiny("1m", shared / "policy", seed=7)
    make_tiny("1m", shared / "scorer", seed=8)
    spread = {"actor": ([1, 1], [ip0, ip1]), "critic": (1, [ip0]), "reward": (1, [ip1])}
    spread = ppo_run(session, shared, "spread", spread)
    one = ppo_run(session, shared, "one", {"actor": (2, [ip1]), "critic": (1, [ip1]), "reward": (1, [ip1])})
    same = {}
    for role in spread["exported"]:
        a, b = weights(spread["exported"][role]), weights(one["exported"][role])
        same[role] = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    return {"spread": spread, "one": one, "weights_equal": same}
