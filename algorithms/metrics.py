"""Per-iteration metrics under the names researchers know (verl's), and the stage clock.

`timing_s/<stage>` is the wall time from when a stage could start — its launch, or when the
results it was launched on became ready, whichever is later — to its own result being ready.
Stages that overlap on disjoint pools each show their own length, so `timing_s/step` is less
than their sum; colocated stages that queue behind each other include their wait. In step()
the clock watches every pending result; run cell by cell, a stage's time ends when its result
was first asked for.

The clock also tags each launched call's trace spans with the iteration and stage they belong
to (`extra["iteration"]`, `extra["stage"]` in `session.trace()`), and with the algorithm's run
name (`extra["run"]`, e.g. "GRPO#2"), so a timeline can be read against the stages.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import ray

from algorithms.core import masked_mean


class StageClock:
    def __init__(self, run: str = ""):
        self.run = run
        """Which algorithm's spans these are (`extra["run"]`): a session may run several."""
        self.iteration = 1
        """The iteration the next launched stages belong to (1-based, as metrics["iteration"])."""
        self.reset()

    def reset(self) -> None:
        self.launched: dict[str, float] = {}
        self.pending: dict[str, list] = {}
        self.inputs: dict[str, set[str]] = {}  # stage -> stages whose results it was launched on
        self.stage_of: dict[int, str] = {}  # id(future) -> stage
        self.finished: dict[str, float] = {}
        self.seconds: dict[str, float] = {}
        self.first: float | None = None

    def launch(self, stage: str, future, *inputs):
        """Start timing `stage`, whose result `future` (a DataFuture) will be ready later;
        `inputs` are the results it was launched on. Launched again before it finished, a
        stage runs from its first launch to its last result."""
        now = time.monotonic()
        self.first = self.first or now
        tags = getattr(future, "trace_tags", None)
        if tags is not None:  # the call's spans in the trace get the iteration and stage
            tags.update(run=self.run, iteration=self.iteration, stage=stage)
        refs = list(future.metas or future.outputs)
        if not refs:
            self.seconds[stage] = 0.0
            return future
        self.launched.setdefault(stage, now)
        self.pending[stage] = self.pending.get(stage, []) + refs
        self.inputs.setdefault(stage, set()).update(self.stage_of[id(i)] for i in inputs if id(i) in self.stage_of)
        self.stage_of[id(future)] = stage
        return future

    def wait(self) -> None:
        """Block until every launched stage is done, noting each one's finishing time."""
        refs = {ref: stage for stage, stage_refs in self.pending.items() for ref in stage_refs}
        remaining = list(refs)
        while remaining:
            ready, remaining = ray.wait(remaining, num_returns=1, fetch_local=False)
            now = time.monotonic()
            for ref in ready:
                stage = refs[ref]
                self.pending[stage].remove(ref)
                if not self.pending[stage]:
                    self.finished[stage] = now
        for stage, launched in self.launched.items():
            ready = max([launched] + [self.finished.get(s, launched) for s in self.inputs.get(stage, ())])
            self.seconds[stage] = self.finished.get(stage, ready) - ready
        self.launched, self.pending = {}, {}

    @contextmanager
    def stage(self, name: str):
        """Time a driver-side stage (advantages, KL shaping)."""
        start = time.monotonic()
        self.first = self.first or start
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - start

    def report(self) -> dict[str, float]:
        """timing_s/* for everything since the last reset, then reset."""
        self.wait()
        out = {f"timing_s/{k}": v for k, v in self.seconds.items()}
        out["timing_s/step"] = time.monotonic() - self.first if self.first else 0.0
        self.reset()
        self.iteration += 1
        return out


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
        gap = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs()
        out["actor/rollout_logprob_diff"] = float(masked_mean(gap, mask))
    stats("response_length", length)
    out["response_length/clip_ratio"] = float((length == mask.shape[1]).float().mean())
    prompt_length = batch["attention_mask"].sum(-1) - length
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

