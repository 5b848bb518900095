"""The workbench against TRL on the same machine, and against the compute limit, in one run.

Cases: GRPO (vs trl 1.16 `GRPOTrainer`) and PPO (vs trl 1.12 `trl.experimental.ppo`, stock) on
the tiny kit's 1m model with 16 new tokens (bookkeeping dominates) and 10m with 64 (compute
dominates). Equal settings on both sides: the same model directory and tokenizer, prompts,
reward (arithmetic exact match for GRPO; the same saved reward-model directory for PPO),
samples per prompt, max new tokens, temperature, learning rate, one optimizer step per batch
(one epoch, one mini-batch), fp32, no KL for GRPO, and the same cores: `--threads` torch
threads in all. TRL runs as it is meant to, one process with all the threads. The workbench
uses its best placement here (`--placement`, default dp2-zero2, picked by measuring those in
PLACEMENTS against the compute limit of the same run; 1x2-zero2 ties it for PPO and loses for
GRPO, see bench/results/vs_trl/session7_NOTES.md): two devices of one thread each, data
parallel, every role fused into one process per device, DeepSpeed ZeRO-2 training (whole
weights on each rank, so the HF rollout reads them: no sync), HF rollout, and compiled forwards
(`--compile`: a static-cache compiled decoding step, compiled training and scoring forwards;
compilation falls in the warm-up iterations, two by default on both sides), and for PPO the
critic's values taken from its update's training forward (`--reuse-values`; the compute limit
then skips that forward too).

The asynchronous workbench is a further column (`--asynchronous`, on by default): the trainer on
one device and a rollout group on the other, one thread each (two extra devices of the session,
idle while the other sides run), generation of the next batch overlapping training on this one
(max staleness `--max-staleness`, default 1; pi_old from the one-step update's own forward), the
same prompts; its seconds per iteration are wall-clock over whole fits, after a warm-up fit.

Each case alternates rounds: a fresh TRL process runs warm-up + measured steps, then the
workbench runs as many iterations on its long-lived groups (then the asynchronous workbench),
then the compute limit is measured:
bare HF `generate` of the same prompts plus the bare forward/backward/optimizer work of the
algorithm on the same rows, in this process with the same threads. Per side: median seconds
per iteration and generated tokens/s (tokens up to and including EOS); ratios are tokens/s of
the workbench over the peer's (> 1: the workbench is faster). Framework overhead: iteration
time minus the compute spans of the trace (workers' calls, and the rule reward's scoring).

The peers' environments (their own transformers) are built by this script into .cache/peers/
the first time. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import peer_env  # bench/peer_env.py: run as `python bench/<script>.py`, this folder is on sys.path
import torch

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "bench"
PEER_REQUIREMENTS = {"grpo": "trl==1.16.0", "ppo": "trl==1.12.0"}
CASES = {  # size -> new tokens
    "1m": 16,
    "10m": 64,
    "30m": 64,
}


# ---- the peers -------------------------------------------------------------------------------
def run_peer(algo: str, settings: dict) -> dict:
    return peer_env.run_peer(f"trl_{algo}.py", PEER_REQUIREMENTS[algo], settings, settings["threads"])


# ---- the workbench ---------------------------------------------------------------------------
PLACEMENTS = {
    # name: (devices, training backend, ZeRO stage). Every role is fused into one process per
    # device, data-parallel over the devices; each process gets threads / devices torch threads.
    "1x2": (1, "fsdp", 2),
    "1x2-zero2": (1, "deepspeed", 2),
    "dp2-fsdp": (2, "fsdp", 2),
    "dp2-zero2": (2, "deepspeed", 2),
}


def build_workbench(session, algo: str, model_dir: Path, reward_dir: Path, args, placement: str):
    """The algorithm with every role fused into one worker process per device of the placement
    (no tensors move between processes of one rank; the HF rollout reads the training weights
    where a rank holds them whole)."""
    from algorithms import GRPO, PPO, Groups, GRPOConfig, PPOConfig
    from workbench.data import arithmetic
    from workbench.engines.contract import OptimConfig
    from workbench.engines.hf_rollout import HFRolloutConfig
    from workbench.engines.rollout import SamplingConfig
    from workbench.engines.vllm_rollout import VLLMRolloutConfig
    from workbench.models.load import LoadConfig
    from workbench.workers import ActorConfig, ActorRolloutRefWorker
    from workbench.workers.rule_reward import RuleReward

    rows = args.rows
    devices, backend, zero_stage = PLACEMENTS[placement]
    load = LoadConfig(compile=args.compile and backend == "deepspeed")  # compiled training: ZeRO-1/2 only
    train = dict(backend=backend, zero_stage=zero_stage, mini_batch_size=rows, micro_batch_size=rows // devices)
    # vLLM engines are pinned one core per rank; one rank gets every core.
    engine = VLLMRolloutConfig(cpu_threads_bind="per-rank" if devices > 1 else f"0-{args.threads - 1}")
    actor_cfg = ActorConfig(
        model_path=str(model_dir),
        rollout=args.rollout,
        reference=(algo == "ppo"),
        optim=OptimConfig(lr=args.lr),
        vllm=engine,
        hf=HFRolloutConfig(compile=args.compile),
        load=load,
        **train,
    )
    pool = session.pool(f"bench_{algo}_{placement}", devices)
    sampling = SamplingConfig(
        max_new_tokens=args.new_tokens, temperature=args.temperature, n=args.n if algo == "grpo" else 1
    )
    if algo == "grpo":
        actor = session.group("actor", ActorRolloutRefWorker, pool, actor_cfg)
        config = GRPOConfig(sampling=sampling, kl_loss_coef=0.0, old_log_probs=args.old_log_probs)
        return GRPO(Groups(actor=actor, reward=RuleReward(arithmetic.score)), config)
    critic, reward = ppo_scorers(reward_dir, args, load, train)
    groups = session.fused(pool, actor=(ActorRolloutRefWorker, actor_cfg), critic=critic, reward=reward)
    config = PPOConfig(sampling=sampling, kl_coef=args.kl_coef, old_log_probs=args.old_log_probs)
    return PPO(
        Groups(actor=groups["actor"], reference=groups["actor"], critic=groups["critic"], reward=groups["reward"]),
        config,
    )


def ppo_scorers(reward_dir: Path, args, load, train: dict) -> tuple[tuple, tuple]:
    """PPO's critic and reward model as (Worker class, config), both from the saved value model."""
    from workbench.engines.contract import OptimConfig
    from workbench.workers.critic import CriticConfig, CriticWorker
    from workbench.workers.reward import RewardModelWorker, ScoreModelConfig

    critic = CriticConfig(
        model_path=str(reward_dir),
        optim=OptimConfig(lr=args.lr),
        load=load,
        reuse_values_forward=args.reuse_values,
        **train,
    )
    reward = ScoreModelConfig(model_path=str(reward_dir), micro_batch_size=args.rows, load=load)
    return (CriticWorker, critic), (RewardModelWorker, reward)


def build_asynchronous(session, algo: str, model_dir: Path, reward_dir: Path, args):
    """The asynchronous workbench on the same cores: the trainer (GRPO: the actor; PPO: actor,
    reference, critic and reward fused in one process) on one device, a rollout group generating
    the next batches on the other (algorithms.asynchronous, max_staleness=args.max_staleness), the
    weights pushed after every update. Same backend and compile settings as the 1x2-zero2
    placement, one torch thread each."""
    from algorithms import GRPO, PPO, Groups, GRPOConfig, PPOConfig
    from workbench.data import arithmetic
    from workbench.engines.contract import OptimConfig
    from workbench.engines.hf_rollout import HFRolloutConfig
    from workbench.engines.rollout import SamplingConfig
    from workbench.engines.vllm_rollout import VLLMRolloutConfig
    from workbench.models.load import LoadConfig
    from workbench.workers import ActorConfig, ActorRolloutRefWorker
    from workbench.workers.rule_reward import RuleReward

    rows = args.rows
    load = LoadConfig(compile=args.compile)
    train = dict(backend="deepspeed", zero_stage=2, mini_batch_size=rows, micro_batch_size=rows)
    common = dict(model_path=str(model_dir), optim=OptimConfig(lr=args.lr), **train)
    trainer_cfg = ActorConfig(**common, rollout=None, reference=(algo == "ppo"), load=load)
    rollout_cfg = ActorConfig(
        **common,
        train=False,
        rollout=args.rollout,
        vllm=VLLMRolloutConfig(cpu_threads_bind="per-rank"),
        hf=HFRolloutConfig(compile=args.compile),
    )
    trainer_pool = session.pool(f"bench_{algo}_async_train", 1)
    rollout = session.group(
        "async_rollout", ActorRolloutRefWorker, session.pool(f"bench_{algo}_async_gen", 1), rollout_cfg
    )
    sampling = SamplingConfig(
        max_new_tokens=args.new_tokens, temperature=args.temperature, n=args.n if algo == "grpo" else 1
    )
    if algo == "grpo":
        actor = session.group("async_actor", ActorRolloutRefWorker, trainer_pool, trainer_cfg)
        config = GRPOConfig(sampling=sampling, kl_loss_coef=0.0, old_log_probs=args.old_log_probs)
        return GRPO(Groups(actor=actor, rollout=rollout, reward=RuleReward(arithmetic.score)), config)
    critic, reward = ppo_scorers(reward_dir, args, load, train)
    groups = session.fused(
        trainer_pool, async_actor=(ActorRolloutRefWorker, trainer_cfg), async_critic=critic, async_reward=reward
    )
    config = PPOConfig(sampling=sampling, kl_coef=args.kl_coef, old_log_probs=args.old_log_probs)
    return PPO(
        Groups(
            actor=groups["async_actor"],
            reference=groups["async_actor"],
            critic=groups["async_critic"],
            reward=groups["async_reward"],
            rollout=rollout,
        ),
        config,
    )


def timed_fit(algorithm, batches: list, iterations: int, max_staleness: int) -> tuple[float, float]:
    """Wall seconds and response tokens of `iterations` asynchronous iterations (the pipeline stays
    filled between calls, so after a warm-up fit this is the steady state)."""
    tokens: list[float] = []
    start = time.perf_counter()
    algorithm.fit(
        batches,
        iterations,
        log=None,
        callbacks=[lambda _algo, batch, _m: tokens.append(float(batch["response_mask"].sum()))],
        asynchronous=True,
        max_staleness=max_staleness,
    )
    return time.perf_counter() - start, sum(tokens)


def compute_seconds(records, since: float) -> float:
    """Wall seconds during which some worker was computing (inputs fetched to output ready), for
    calls that started after `since`: the union of those spans over every rank, so ranks that
    compute at the same time count once (the trace holds every span of the session)."""
    spans = sorted((r.fetched, r.end) for r in records if r.start >= since and r.call_id >= 0)
    total, reach = 0.0, float("-inf")
    for start, end in spans:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


# ---- the compute limit -------------------------------------------------------------------------
class ComputeLimit:
    """The bare work of one iteration in this process: HF generate of the same prompts, then
    each forward (and forward/backward/AdamW step) the algorithm needs on the same rows."""

    def __init__(self, algo: str, model_dir: Path, reward_dir: Path, args):
        from workbench.engines.hf_rollout import HFRollout
        from workbench.models import load
        from workbench.models.value import load_value_model

        self.algo, self.args = algo, args
        loaded = load(model_dir)
        self.policy = loaded.model
        self.rollout = HFRollout(self.policy, loaded.tokenizer.pad_token_id, loaded.tokenizer.eos_token_id)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=args.lr)
        if algo == "ppo":
            self.reference = load(model_dir).model.eval()
            self.critic = load_value_model(reward_dir).model
            self.critic_optimizer = torch.optim.AdamW(self.critic.parameters(), lr=args.lr)
            self.reward = load_value_model(reward_dir).model.eval()

    def iteration(self, prompts, sampling) -> float:
        from workbench.engines.forward import response_log_probs, response_values

        start = time.perf_counter()
        batch = self.rollout.generate(prompts, sampling)
        mask = batch["response_mask"].float()
        if self.algo == "ppo":
            with torch.no_grad():
                response_log_probs(self.reference, batch)
                response_values(self.reward, batch)
                if not self.args.reuse_values:  # else the training forward below gives the values
                    response_values(self.critic, batch)
            self.critic.train()
            loss = (response_values(self.critic, batch) * mask).sum() / mask.sum()
            loss.backward()
            self.critic_optimizer.step()
            self.critic_optimizer.zero_grad()
        self.policy.train()
        log_probs, _ = response_log_probs(self.policy, batch, sampling.temperature)
        loss = -(log_probs * mask).sum() / mask.sum()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.policy.eval()
        return time.perf_counter() - start


# ---- one case ----------------------------------------------------------------------------------
def run_case(session, algo: str, size: str, args) -> dict:
    from workbench.data import arithmetic
    from workbench.data.prompts import tokenize_prompts
    from workbench.engines.rollout import SamplingConfig
    from workbench.models import load, make_tiny
    from workbench.models.value import load_value_model

    new_tokens = CASES[size]
    args = replace_ns(args, new_tokens=new_tokens)
    model_dir = make_tiny(size, CACHE / f"tiny-{size}")
    reward_dir = CACHE / f"tiny-{size}-value"
    if not (reward_dir / "config.json").exists():  # one saved value model: both sides load these weights
        loaded = load_value_model(model_dir)
        loaded.model.save_pretrained(reward_dir)
        loaded.tokenizer.save_pretrained(reward_dir)
    tokenizer = load(model_dir).tokenizer
    prompts_per_step = args.rows // (args.n if algo == "grpo" else 1)
    steps = args.warmup + args.iterations
    problems = arithmetic.generate(
        arithmetic.ArithmeticConfig(digits=2), prompts_per_step * steps * args.rounds, seed=0
    )
    rows = [{"prompt": p.prompt, "ground_truth": p.ground_truth} for p in problems]
    batches = [
        tokenize_prompts(rows[i : i + prompts_per_step], tokenizer, max_prompt_length=32)
        for i in range(0, len(rows), prompts_per_step)
    ]
    sampling = SamplingConfig(
        max_new_tokens=new_tokens, temperature=args.temperature, n=args.n if algo == "grpo" else 1
    )

    torch.set_num_threads(args.threads)
    algorithm = build_workbench(session, algo, model_dir, reward_dir, args, args.placement)
    limit = ComputeLimit(algo, model_dir, reward_dir, args)
    for b in batches[: args.warmup]:
        algorithm.step(b)
        limit.iteration(b, sampling)
    asynchronous = build_asynchronous(session, algo, model_dir, reward_dir, args) if args.asynchronous else None
    if asynchronous is not None:  # compiles, and fills the pipeline
        timed_fit(asynchronous, batches[: args.warmup], args.warmup, args.max_staleness)
    async_seconds, async_tokens = 0.0, 0.0

    ours, ours_tokens, overhead, peer, peer_tokens, bare = [], [], [], [], [], []
    step_times: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        settings = {
            "repo": str(ROOT),
            "model": str(model_dir),
            "reward_model": str(reward_dir),
            "threads": args.threads,
            "seed": round_,
            "rows": args.rows,
            "n": args.n,
            "new_tokens": new_tokens,
            "temperature": args.temperature,
            "lr": args.lr,
            "kl_coef": args.kl_coef,
            "steps": steps,
            "prompts": rows[round_ * prompts_per_step * steps : (round_ + 1) * prompts_per_step * steps],
        }
        result = run_peer(algo, settings)
        peer += result["seconds"][args.warmup :]
        peer_tokens += result["tokens"][args.warmup :]
        since = time.time()
        for b in batches[args.warmup + round_ * args.iterations : args.warmup + (round_ + 1) * args.iterations]:
            batch, metrics = algorithm.step(b)
            ours.append(metrics["timing_s/step"])
            ours_tokens.append(float(batch["response_mask"].sum()))
            for k, v in metrics.items():
                if k.startswith("timing_s/"):
                    step_times.setdefault(k, []).append(v)
        records = session.trace()
        overhead.append(1 - compute_seconds(records, since) / sum(ours[-args.iterations :]))
        if asynchronous is not None:  # the same prompts, as many iterations
            first = args.warmup + round_ * args.iterations
            seconds, tokens = timed_fit(
                asynchronous, batches[first : first + args.iterations], args.iterations, args.max_staleness
            )
            async_seconds, async_tokens = async_seconds + seconds, async_tokens + tokens
        for b in batches[: args.iterations]:
            bare.append(limit.iteration(b, sampling))

    ours_tps = sum(ours_tokens) / sum(ours)
    peer_tps = sum(peer_tokens) / sum(peer)
    result = {
        "workbench_s": round(statistics.median(ours), 3),
        "trl_s": round(statistics.median(peer), 3),
        "limit_s": round(statistics.median(bare), 3),
        "workbench_tokens_per_s": round(ours_tps, 1),
        "trl_tokens_per_s": round(peer_tps, 1),
        "ratio": round(ours_tps / peer_tps, 3),
        "vs_limit": round(statistics.median(ours) / statistics.median(bare), 3),
        "overhead": round(statistics.median(overhead), 4),
        "steps_s": {k.removeprefix("timing_s/"): round(statistics.median(v), 3) for k, v in step_times.items()},
    }
    if asynchronous is not None:
        async_tps = async_tokens / async_seconds
        result |= {
            "async_s": round(async_seconds / (args.rounds * args.iterations), 3),
            "async_tokens_per_s": round(async_tps, 1),
            "async_ratio": round(async_tps / peer_tps, 3),
            "async_vs_sync": round(async_tps / ours_tps, 3),
        }
    print(
        f"[{algo} {size}, {new_tokens} new tokens] workbench {result['workbench_s']} s/it "
        f"({result['workbench_tokens_per_s']} tok/s) | TRL {result['trl_s']} s/it ({result['trl_tokens_per_s']} tok/s) "
        f"-> x{result['ratio']} | compute limit {result['limit_s']} s (workbench x{result['vs_limit']} of it), "
        f"framework overhead {result['overhead']:.1%} | steps {result['steps_s']}"
        + (
            f" | asynchronous (s={args.max_staleness}) {result['async_s']} s/it ({result['async_tokens_per_s']} tok/s)"
            f" -> x{result['async_ratio']} TRL, x{result['async_vs_sync']} synchronous"
            if asynchronous is not None
            else ""
        ),
        flush=True,
    )
    session.clear()
    return result


def replace_ns(ns: argparse.Namespace, **changes) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(ns), **changes})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algos", default="grpo,ppo")
    parser.add_argument("--sizes", default="1m,10m")
    parser.add_argument("--rows", type=int, default=64, help="rows (responses) per iteration")
    parser.add_argument("--n", type=int, default=8, help="GRPO samples per prompt")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--kl-coef", type=float, default=0.05, help="PPO's KL-in-reward coefficient (both sides)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each side's one process")
    parser.add_argument(
        "--warmup", type=int, default=2, help="unmeasured iterations per side (the workbench compiles in them)"
    )
    parser.add_argument("--iterations", type=int, default=3, help="measured iterations per side per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--old-log-probs", default="auto", help="the workbench's AlgoConfig.old_log_probs")
    parser.add_argument(
        "--placement",
        default="dp2-zero2",
        choices=sorted(PLACEMENTS),
        help="the workbench's placement: devices x threads each, and the training backend",
    )
    parser.add_argument(
        "--rollout",
        default="hf",
        choices=("hf", "vllm"),
        help="the workbench's rollout backend (vLLM engines: one core per rank, all cores for one rank)",
    )
    parser.add_argument(
        "--compile",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="the workbench compiles its forwards: decoding (HFRolloutConfig.compile) and every "
        "training and scoring forward (LoadConfig.compile); compilation falls in the warm-up",
    )
    parser.add_argument(
        "--reuse-values",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="PPO: the critic's values come from its update's training forward, which is kept "
        "(CriticConfig.reuse_values_forward; exact for the one-step update here)",
    )
    parser.add_argument(
        "--asynchronous",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="also run the asynchronous workbench (a column): the trainer on one device, a rollout "
        "group on the other, generation overlapping training (algorithms.asynchronous)",
    )
    parser.add_argument("--max-staleness", type=int, default=1, help="the asynchronous column's staleness bound")
    args = parser.parse_args()

    from workbench import Session

    for algo in args.algos.split(","):
        peer_env.peer_python(PEER_REQUIREMENTS[algo])
    results = {}
    devices = PLACEMENTS[args.placement][0]
    # The asynchronous column's two one-device pools are extra devices: idle while the other side runs.
    extra = 2 if args.asynchronous else 0
    with Session(num_devices=devices + extra, threads_per_worker=max(1, args.threads // devices)) as session:
        for algo in args.algos.split(","):
            for size in args.sizes.split(","):
                results[f"{algo}_{size}"] = run_case(session, algo, size, args)
    ratios = {f"ratio_{k}": v["ratio"] for k, v in results.items()}
    async_ratios = {f"async_ratio_{k}": v["async_ratio"] for k, v in results.items() if "async_ratio" in v}
    print(
        json.dumps(
            {
                "bench": "vs_trl",
                **ratios,
                "ratio_min": min(ratios.values()),
                **async_ratios,
                "vs_limit_max": max(v["vs_limit"] for v in results.values()),
                "overhead_max": max(v["overhead"] for v in results.values()),
                "cases": results,
                "settings": {
                    "rows": args.rows,
                    "n": args.n,
                    "temperature": args.temperature,
                    "lr": args.lr,
                    "kl_coef": args.kl_coef,
                    "threads": args.threads,
                    "warmup": args.warmup,
                    "iterations": args.iterations,
                    "rounds": args.rounds,
                    "old_log_probs": args.old_log_probs,
                    "workbench_placement": args.placement,
                    "placements": PLACEMENTS,
                    "rollout": args.rollout,
                    "compile": args.compile,
                    "reuse_values": args.reuse_values,
                    "asynchronous": args.asynchronous,
                    "max_staleness": args.max_staleness,
                    "peers": PEER_REQUIREMENTS,
                    "new_tokens": CASES,
                },
            }
        )
    )


if __name__ == "__main__":
    main()
