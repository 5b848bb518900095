"""Per-iteration metrics under the names researchers know (verl's).

The step times (`timing_s/<step>`) come from the step clock, `workbench.clock.StepClock`.
"""

from __future__ import annotations

from algorithms.core import masked_mean, rollout_logprob_diff


def data_metrics(batch) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of one iteration's batch."""
    mask = batch["response_mask"].float()
    length = mask.sum(-1)
    out = {}

    def stats(name, values):
        out[f"{name}/mean"] = float(values.mean())
        out[f"{name}/max"] = float(values.max())
        out[f"{name}/min"] = float(values.min())

    stats("critic/score", batch["token_level_scores"].sum(-1))
    for key in batch.keys():  # several reward (cost) functions: each one's mean, and rows that fell back
        if key.startswith(("reward/", "cost/")):
            fallbacks = key.endswith("/fallbacks")
            out[key if fallbacks else f"{key}/mean"] = float(batch[key].sum() if fallbacks else batch[key].mean())
    if "token_level_rewards" in batch:
        stats("critic/rewards", batch["token_level_rewards"].sum(-1))
    for key in ("advantages", "returns", "values"):
        if key in batch:
            valid = batch[key][mask.bool()]
            out[f"critic/{key}/mean"] = float(masked_mean(batch[key], mask))
            out[f"critic/{key}/max"] = float(valid.max()) if valid.numel() else 0.0
            out[f"critic/{key}/min"] = float(valid.min()) if valid.numel() else 0.0
    if "rollout_log_probs" in batch and "old_log_probs" in batch:
        # The generation weights against the training weights, every iteration: a stale or
        # corrupted weight sync shows up here at once (0 when the rollout's are reused).
        diff = rollout_logprob_diff(batch["rollout_log_probs"], batch["old_log_probs"], mask)
        out["actor/rollout_logprob_diff"] = diff
    stats("response_length", length)
    out["response_length/clip_ratio"] = float((length == mask.shape[1]).float().mean())
    prompt_length = batch["attention_mask"].sum(-1) - length
    if "turns" in batch:  # multi-turn episodes (workbench.engines.multi_turn)
        observed = batch["observation_tokens"]
        prompt_length = prompt_length - observed
        stats("episode/turns", batch["turns"])
        stats("episode/length", length + observed)  # policy and observation tokens
        out["episode/tool_calls"] = float(batch["tool_calls"].sum())
        out["episode/tool_errors"] = float(batch["tool_errors"].sum())
        if "tool_output_cuts" in batch:
            out["episode/tool_output_cuts"] = float(batch["tool_output_cuts"].sum())
        out["episode/observation_tokens/mean"] = float(observed.mean())
    out["prompt_length/mean"] = float(prompt_length.float().mean())
    out["perf/total_tokens"] = float(batch["attention_mask"].sum())
    return out


def throughput(metrics: dict[str, float]) -> float:
    """Tokens (prompt + response) through the whole iteration per second of its wall time."""
    seconds = metrics.get("timing_s/step", 0.0)
    return metrics["perf/total_tokens"] / seconds if seconds > 0 else 0.0


def format_line(iteration: int, metrics: dict[str, float], keys: tuple[str, ...]) -> str:
    """One compact log line: `iter 3  score 0.62  pg_loss -0.013 ...`."""
    parts = [f"iter {iteration:>3}"]
    for key in keys:
        if key in metrics:
            short = key.removeprefix("actor/").removeprefix("critic/").removesuffix("/mean")
            parts.append(f"{short}={metrics[key]:.4g}")
    return "  ".join(parts)
