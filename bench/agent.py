"""Multi-turn, tool-using RL (issue 25): the tool task before and after GRPO over episodes, and
what the multi-turn rollout costs against single-turn generation.

- the task: 3-digit x 2-digit products as a chat that offers a calculator
  (workbench.data.tool_multiply); held-out problems share none with training.
- the start (SFT only): the tiny chat kit after a short SFT on 300 multi-turn demonstrations,
  30% of them using the calculator (workbench.stages.tool_policy; cached).
- RL: GRPO over episodes (the calculator in a sandbox process, up to 3 turns), `--iterations`
  iterations of `--prompts` training problems x `--n` episodes.
- measured before and after RL, greedy, on `--heldout` problems: exact match with tools allowed
  (up to 3 turns) and without (the no-calculator prompt, one turn), the tool-call rate (episodes
  that called a tool), the tool error rate (failed calls over calls).
- throughput: the multi-turn rollout's policy tokens per second against single-turn generation
  of the same number of policy tokens (the same prompts, max_new_tokens = the episodes' policy
  tokens per row) on the same engine (the actor's rollout: `--engine hf` or `vllm`), `--rounds`
  alternating rounds, medians. Goal: >= 0.9x (on vLLM each episode's next turn goes to the
  engine as soon as its tool answered: continuous scheduling).
- tool_call_ms: a calculator call's round trip through the tool sandbox (its jail), median.

`--model DIR` starts from another chat model directory instead (e.g. SmolLM2-135M-Instruct from
`python -m workbench import-model smollm2`): no SFT, its own chat template.
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import psutil
import torch

from algorithms import GRPO, Groups, GRPOConfig
from workbench import Session
from workbench.agents import ToolEnvironment, calculator
from workbench.data import tool_multiply
from workbench.data.batch import Batch
from workbench.data.prompts import left_padded, tokenize_prompts
from workbench.engines.contract import OptimConfig
from workbench.engines.multi_turn import EpisodeConfig
from workbench.engines.rollout import SamplingConfig
from workbench.engines.vllm_rollout import VLLMRolloutConfig
from workbench.models import load_tokenizer
from workbench.stages.tool_policy import ToolPolicyConfig, tool_policy
from workbench.workers import ActorConfig, ActorRolloutRefWorker
from workbench.workers.episode_reward import EpisodeReward

WITH_TOOLS = EpisodeConfig(max_turns=3, turn_tokens=40, max_tokens=96)
WITHOUT_TOOLS = EpisodeConfig(max_turns=1, turn_tokens=40, max_tokens=40)
GOAL = 0.9
"""Multi-turn policy tokens/s over single-turn generation's of the same tokens, wall and CPU."""


def rows(problems, tools: bool = True) -> list[dict]:
    return [{"prompt": tool_multiply.messages(p, tools), "ground_truth": p.ground_truth} for p in problems]


def evaluate(actor, tokenizer, heldout, env) -> dict[str, float]:
    """Greedy episodes on the held-out problems, with tools allowed and without."""
    greedy = SamplingConfig(greedy=True)
    out = {}
    for tools, episode in ((True, WITH_TOOLS), (False, WITHOUT_TOOLS)):
        batch = actor.generate_episodes(tokenize_prompts(rows(heldout, tools), tokenizer, 96), env, greedy, episode)
        batch = batch.get()
        key = "with_tools" if tools else "without_tools"
        out[f"exact_match_{key}"] = float(batch["episode_reward"].mean())
        out[f"tool_call_rate_{key}"] = float((batch["tool_calls"] > 0).float().mean())
        calls = float(batch["tool_calls"].sum())
        out[f"tool_error_rate_{key}"] = float(batch["tool_errors"].sum()) / calls if calls else 0.0
        if tools:
            out["turns_mean"] = float(batch["turns"].mean())
    return out


class Clock:
    """Wall seconds of a call, and CPU seconds of the worker process and its children (the tool
    sandbox) over it: on a shared machine the CPU time is what the work cost, the wall time also
    what the other jobs took."""

    def __init__(self, pid: int):
        self.process = psutil.Process(pid)

    def cpu(self) -> float:
        processes = [self.process, *self.process.children(recursive=True)]
        return sum(sum(p.cpu_times()[:2]) for p in processes if p.is_running())

    def __call__(self, call, *args):
        """call(*args).get(), and its (wall, cpu) seconds."""
        wall, cpu = time.perf_counter(), self.cpu()
        out = call(*args).get()
        return out, (time.perf_counter() - wall, self.cpu() - cpu)


def tool_call_ms(env, rounds: int = 5, calls: int = 50) -> float:
    """A calculator call's round trip through the environment's tool sandbox (its jail), in
    milliseconds: the median of `rounds` rounds of `calls` calls, after one to start it."""
    env.toolbox.call("calculator", {"expression": "1 + 1"})
    medians = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            env.toolbox.call("calculator", {"expression": "123 * 45"})
        medians.append((time.perf_counter() - start) / calls * 1000)
    return statistics.median(medians)


def with_observations(prompts: Batch, episodes: Batch, pad: int) -> Batch:
    """Each prompt followed by its episode's observation tokens (attended, not the policy's)."""
    observation = (
        episodes["attention_mask"][:, prompts["input_ids"].shape[1] :].bool() & ~episodes["response_mask"].bool()
    )
    contexts = [
        ids[mask.bool()].tolist() + responses[shown].tolist()
        for ids, mask, responses, shown in zip(
            prompts["input_ids"], prompts["attention_mask"], episodes["responses"], observation
        )
    ]
    ids, mask = left_padded(contexts, pad, prompts["input_ids"].device)
    return Batch({"input_ids": ids, "attention_mask": mask})


def throughput(actor, clock: Clock, tokenizer, heldout, env, rounds: int, seed: int) -> dict:
    """Policy tokens per second of the multi-turn rollout against single-turn generation of the
    same policy tokens, alternating in each round; the ratios are medians of the rounds' ratios,
    by wall and by CPU time. Two single-turn baselines:
    - matched: every row generates as many tokens as its episode's policy tokens (one turn that
      long: the batch decodes to its longest row, as a single-turn rollout of responses of those
      lengths does). The multi-turn overhead alone: extra turns, tool calls, observations.
    - uniform: every row generates the same number of tokens, the episodes' mean: also the cost
      of episodes of different lengths sharing a batched turn (an engine without continuous
      batching decodes a finished row until the batch's longest is done).
    Neither computes the observations (`observation_tokens`: the tool's answers in their
    template, ~14 a call), which the multi-turn rollout must. A third does, as a diagnostic:
    - observed: `matched` from prompts followed by their episode's observation tokens: the
      rollout's compute (prefill of prompts and observations, the same decoding steps) in one
      turn, so multi-turn over it is what the turns' scheduling costs (a second engine call per
      turn, tool calls, waiting), without the observations' compute."""
    prompts = tokenize_prompts(rows(heldout), tokenizer, 96)
    kinds = ("multi_turn", "single_turn_matched", "single_turn_uniform", "single_turn_observed")
    rates: dict[str, dict[str, list[float]]] = {by: {k: [] for k in kinds} for by in ("wall", "cpu")}
    tokens, observed = [], []
    for r in range(rounds):
        episodes, seconds = clock(actor.generate_episodes, prompts, env, SamplingConfig(seed=seed + r), WITH_TOOLS)
        per_row = episodes["response_mask"].sum(1)
        policy_tokens, longest = int(per_row.sum()), int(per_row.max())
        mean = math.ceil(policy_tokens / len(prompts))
        matched = SamplingConfig(max_new_tokens=longest, min_new_tokens=longest, seed=seed + r)
        _, matched_seconds = clock(actor.generate_sequences, prompts, matched)
        uniform = SamplingConfig(max_new_tokens=mean, min_new_tokens=mean, seed=seed + r)
        out, uniform_seconds = clock(actor.generate_sequences, prompts, uniform)
        assert int(out["response_mask"].sum()) == mean * len(prompts)  # min_new_tokens held every row
        _, observed_seconds = clock(
            actor.generate_sequences, with_observations(prompts, episodes, tokenizer.pad_token_id), matched
        )
        timed = {
            "multi_turn": (policy_tokens, seconds),
            "single_turn_matched": (policy_tokens, matched_seconds),
            "single_turn_uniform": (mean * len(prompts), uniform_seconds),
            "single_turn_observed": (policy_tokens, observed_seconds),
        }
        for kind, (count, (wall, cpu)) in timed.items():
            rates["wall"][kind].append(count / wall)
            rates["cpu"][kind].append(count / cpu)
        tokens.append(policy_tokens)
        observed.append(int(torch.as_tensor(episodes["observation_tokens"]).sum()))

    def ratio(by: str, baseline: str) -> float:
        return statistics.median(m / b for m, b in zip(rates[by]["multi_turn"], rates[by][baseline]))

    return {
        "ratio": ratio("wall", "single_turn_matched"),
        "ratio_uniform": ratio("wall", "single_turn_uniform"),
        "ratio_cpu": ratio("cpu", "single_turn_matched"),
        "ratio_uniform_cpu": ratio("cpu", "single_turn_uniform"),
        "ratio_observed": ratio("wall", "single_turn_observed"),
        "ratio_observed_cpu": ratio("cpu", "single_turn_observed"),
        "tokens_per_s": {kind: statistics.median(rates["wall"][kind]) for kind in kinds},
        "tokens_per_cpu_s": {kind: statistics.median(rates["cpu"][kind]) for kind in kinds},
        "policy_tokens": tokens,
        "observation_tokens": observed,
        "rounds": rates,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="a chat model directory (default: the tiny kit + SFT)")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=16, help="training problems per iteration")
    parser.add_argument("--n", type=int, default=4, help="episodes per problem (GRPO's group)")
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--heldout", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="throughput rounds")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="the actor's rollout engine")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write result.json here")
    args = parser.parse_args()

    policy = ToolPolicyConfig(seed=args.seed)
    start = time.perf_counter()
    model_dir = args.model or tool_policy(policy)
    sft_seconds = time.perf_counter() - start
    tokenizer, _ = load_tokenizer(model_dir)
    train, heldout = tool_multiply.split(
        tool_multiply.MultiplyConfig(), args.prompts * args.iterations, args.heldout, seed=args.seed
    )
    env = ToolEnvironment({"calculator": calculator}, tool_multiply.score)

    session = Session(num_devices=1)
    try:
        rows_per_iteration = args.prompts * args.n
        actor = session.group(
            "actor",
            ActorRolloutRefWorker,
            session.pool("actor_pool", 1),
            ActorConfig(
                model_path=str(model_dir),
                optim=OptimConfig(lr=args.lr),
                mini_batch_size=rows_per_iteration,
                micro_batch_size=16,
                rollout=args.engine,
                vllm=VLLMRolloutConfig(max_model_len=256, max_num_seqs=64, cpu_threads_bind="per-rank"),
            ),
        )
        before = evaluate(actor, tokenizer, heldout, env)
        start_label = "SFT only" if args.model is None else "before RL"
        print(f"{start_label}:", json.dumps(before))
        grpo = GRPO(
            Groups(actor=actor, reward=EpisodeReward()),
            GRPOConfig(
                sampling=SamplingConfig(n=args.n, seed=args.seed),
                kl_loss_coef=0.0,
                env=env,
                episode=WITH_TOOLS,
            ),
        )
        batches = [
            tokenize_prompts(rows(train[i : i + args.prompts]), tokenizer, 96)
            for i in range(0, len(train), args.prompts)
        ]
        start = time.perf_counter()
        history = grpo.fit(batches, args.iterations, log=None)
        rl_seconds = time.perf_counter() - start
        for i, m in enumerate(history, 1):
            print(
                f"iteration {i}: score {m['critic/score/mean']:.3f}  tool calls {m['episode/tool_calls']:.0f}/"
                f"{rows_per_iteration}  tool errors {m['episode/tool_errors']:.0f}  turns {m['episode/turns/mean']:.2f}"
                f"  {m['timing_s/step']:.1f} s"
            )
        after = evaluate(actor, tokenizer, heldout, env)
        print(f"{'SFT + RL' if args.model is None else 'after RL'}:", json.dumps(after))
        pid = next(r.pid for r in session.trace() if r.role == "actor" and r.method == "generate_episodes")
        speed = throughput(actor, Clock(pid), tokenizer, heldout, env, args.rounds, args.seed + 1000)
        print("throughput:", json.dumps(speed))
        call_ms = tool_call_ms(env)
        print(f"a calculator call through the sandbox: {call_ms:.3f} ms")
    finally:
        session.shutdown()

    result = {
        "model": str(args.model) if args.model else f"tiny-chat-{policy.size} + SFT ({policy.steps} steps)",
        "engine": args.engine,
        "sft_seconds": sft_seconds,
        "rl_seconds": rl_seconds,
        "iterations": args.iterations,
        "episodes_per_iteration": rows_per_iteration,
        "heldout": args.heldout,
        "before": before,
        "after": after,
        "score_per_iteration": [m["critic/score/mean"] for m in history],
        "tool_calls_per_iteration": [m["episode/tool_calls"] / rows_per_iteration for m in history],
        "throughput": speed,
        "tool_call_ms": call_ms,
        "goal_throughput_ratio": GOAL,
        "throughput_goal_met": min(speed["ratio"], speed["ratio_cpu"]) >= GOAL,
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
