"""The headless runner: `python -m workbench run config.yaml [field=value ...]`.

One run = a Session, the worker groups the config places on its pools, an algorithm, and a
loop the runner drives itself, one `algorithm.step(batch)` per iteration:

    step -> rollout log (every k) -> held-out evaluation (every k) -> metrics row -> checkpoint (every k) -> callbacks

Each metrics row also holds every role's peak memory per process (`perf/peak_rss_gib/actor/rank0`,
...: workbench.tracing.memory_metrics over the iteration's spans).

Faults. A worker process that dies (WorkerDiedError, or a group found removed) is restarted on
its pool (`session.recover`), every group and the driver are reloaded from the last checkpoint,
and the run goes on from there: the failed iteration is redone, not skipped (`run/redone`,
`run/recoveries` in its metrics), at most `faults.max_recoveries` times. A reward or cost
function that raises, returns NaN/inf or runs out of time fails the step before any update;
the iteration is retried up to `faults.reward_retries` times, then the run stops with an
error naming the function and the row.
"""

from __future__ import annotations

import itertools
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm

from algorithms.metrics import format_line
from workbench.errors import ConfigError
from workbench.models import load_tokenizer
from workbench.run import build, faults
from workbench.run.checkpoint import RunCheckpointer
from workbench.run.config import RunConfig, load_config
from workbench.run.logs import MetricLog, last_logged_iteration, rollout_rows, write_rows
from workbench.session import Session
from workbench.tracing import memory_metrics, save_chrome_trace, save_records, tags
from workbench.workers import rule_reward

RUN_FILES = (
    "config.yaml",
    "plan.yaml",
    "metrics.jsonl",
    "rollouts.jsonl",
    "trace.json",
    "trace.jsonl",
    "tensorboard",
    "hf",
)
"""What a run writes in its output directory (a fresh run replaces these, and nothing else)."""


@dataclass
class RunResult:
    """Where a run's outputs went, and how it went."""

    output_dir: Path
    files: dict[str, Path]
    """By kind: config, metrics, rollouts, tensorboard, trace, checkpoints, hf_* (when written)."""
    iterations: int
    """The algorithm's iteration count at the end."""
    recoveries: int = 0
    reward_retries: int = 0
    history: list[dict] = field(default_factory=list)
    """Every iteration's metrics row, as written to metrics.jsonl (redone ones twice)."""
    evaluations: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    faults: list[dict] = field(default_factory=list)
    """Each failure the run recovered from: its iteration, the error's first line, and the
    seconds from the failed iteration's start to the error."""

    def listing(self) -> str:
        lines = [f"outputs in {self.output_dir}/"]
        for kind, path in self.files.items():
            lines.append(f"  {kind:<12} {path}{_describe(path)}")
        return "\n".join(lines)


class _Rewound(Exception):
    """The algorithm went back to a checkpoint: continue the loop from its iteration."""


class Runner:
    """Runs one RunConfig. `callbacks` are called after every iteration as
    `callback(algorithm, batch, metrics)` (like `Algorithm.fit`'s); one returning False stops
    the run there. A `session` given is used (and cleared at the end) instead of a new one."""

    def __init__(self, config: RunConfig, session: Session | None = None, callbacks: Iterable[Callable] = ()):
        config.validate()
        build.algorithm_config(config)  # sampling against the algorithm (GRPO's n >= 2, ...), before any work
        # The task's pieces too: reward files and functions, the cost, the judge's settings, the environment.
        build.rewards(config)
        if "cost" in build.required_roles(config):
            build.cost(config)
        elif config.data.cost_function:
            raise ConfigError(
                "data.cost_function", config.data.cost_function, f"{config.algorithm_name} has no cost: use safe_rlhf"
            )
        if config.data.judge is not None:
            build.judge_config(config, Path(config.model.path or "<the policy>"))
        if config.data.environment:
            build.environment_of(config).close()
        self.config, self.given_session, self.callbacks = config, session, list(callbacks)
        self.session: Session | None = None
        self.algorithm = None
        self.tokenizer = None
        self.eval_batch = None
        self.checkpointer = None
        self.recoveries = self.reward_retries = 0
        self.faults: list[dict] = []
        self.iteration_started = 0.0
        self.redo_until = 0  # iterations up to here were started before (then lost to a fault): a redo
        self.history: list[dict] = []
        self.loop_started = 0.0  # when the loop began: time_limit_s and run/elapsed_s count from here
        self.evaluations: list[dict] = []
        self.exported: dict[str, Path] = {}
        self.plan: build.RunPlan | build.CallRunPlan | None = None

    # ---- the run ------------------------------------------------------------------------------
    def run(self) -> RunResult:
        cfg, out = self.config, self.config.output_dir
        started = time.time()
        resume = self._prepare_output(out)
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        policy = build.model_dir(cfg)
        self.tokenizer, _ = load_tokenizer(policy, cfg.actor.load)
        loader, self.eval_batch = build.prompt_data(cfg, self.tokenizer)
        width = loader.mean_width() if cfg.placement.plan is not None else None  # only a plan is priced
        self.plan = build.run_plan(cfg, policy, width)  # read, priced and checked before any worker starts
        if self.plan is not None:
            self._write_plan()
        self.session = self.given_session or Session(
            num_devices=cfg.placement.num_devices or build.devices_needed(cfg, self.plan),
            threads_per_worker=cfg.placement.threads_per_worker,
        )
        log = None
        try:
            self.algorithm = build.algorithm(cfg, self.session, policy, self.plan)
            if cfg.checkpoint.every or cfg.checkpoint.export_hf:
                self.checkpointer = RunCheckpointer(cfg.checkpoint_dir, keep=max(1, cfg.checkpoint.keep))
            self._start(resume)
            log = MetricLog(
                out,
                cfg.logging.tensorboard,
                cfg.logging.wandb_project if cfg.logging.wandb else None,
                cfg.name,
                cfg.to_dict(),
            )
            self._loop(loader, log)
            if cfg.checkpoint.export_hf:
                exported = self.checkpointer.export_hf(self.algorithm, out / "hf")
                self.exported = {f"hf_{role}": Path(path) for role, path in exported.items()}
        finally:
            if log is not None:
                log.close()
            if self.plan is not None:
                self._write_plan()
            self._finish(out, started)
        result = self.result(started)
        if self.plan is not None:
            print(self._plan_line())
        print(
            f"run {cfg.name!r}: {cfg.algorithm_name}, {result.iterations} iterations in {result.seconds:.1f} s"
            f" ({self.recoveries} recoveries, {self.reward_retries} reward retries)"
        )
        print(result.listing())
        return result

    def _loop(self, loader, log: MetricLog) -> None:
        cfg, algo = self.config, self.algorithm
        bar = tqdm(
            total=cfg.iterations,
            initial=algo.iteration,
            desc=cfg.name,
            unit="it",
            disable=not cfg.logging.progress,
            file=sys.stderr,
            dynamic_ncols=True,
        )
        self.loop_started = time.time()
        try:
            if cfg.evaluation.every and cfg.evaluation.at_start and algo.iteration == 0:
                try:
                    log.write(0, {**self._guarded(self.evaluate), "run/elapsed_s": 0.0})
                except _Rewound:  # a worker died during it; recovered to the start: train on
                    pass
            batches = loader.batches(self._drawn())  # the loader's position: batches drawn so far
            while algo.iteration < cfg.iterations:
                try:
                    stop = self._iteration(batches, log, bar)
                except _Rewound:
                    batches = loader.batches(self._drawn())
                    bar.n = algo.iteration
                    bar.refresh()
                    continue
                if stop:
                    break
        finally:
            bar.close()

    def _drawn(self) -> int:
        """Prompt batches drawn so far: one per iteration, and those launched ahead (asynchronous)."""
        queue = self.algorithm.rollouts
        return queue.launched if queue is not None else self.algorithm.iteration

    def _iteration(self, batches, log: MetricLog, bar) -> bool:
        """One iteration and what follows it; True when a callback asks to stop."""
        cfg, algo = self.config, self.algorithm
        started = self.iteration_started = time.time()
        batch, metrics = self._guarded(self._step, batches)
        it = algo.iteration
        # Out of time (time_limit_s): this is the last iteration, evaluated and saved as one.
        timed_out = bool(cfg.time_limit_s) and time.time() - self.loop_started >= cfg.time_limit_s
        last = cfg.iterations if not timed_out else it
        metrics = {
            **metrics,
            **self.memory(since=started),
            "run/recoveries": float(self.recoveries),
            "run/redone": float(it <= self.redo_until),
            "run/reward_retries": float(self.reward_retries),
        }
        if self.plan is not None:  # the planner's estimate beside the measured timing_s/step
            metrics["planner/estimated_iteration_s"] = self.plan.estimated_iteration_s
        if _due(it, cfg.logging.rollouts_every, last):
            write_rows(
                cfg.output_dir / "rollouts.jsonl", rollout_rows(batch, self.tokenizer, it, cfg.logging.rollout_rows)
            )
        if _due(it, cfg.evaluation.every, last):
            metrics |= self._guarded(self.evaluate)
        metrics["run/elapsed_s"] = time.time() - self.loop_started  # training and evaluation, since the first
        log.write(it, metrics)
        self.history.append({"iteration": it, **metrics})
        if cfg.logging.print_every and it % cfg.logging.print_every == 0:
            tqdm.write(format_line(it, metrics, algo.log_keys))
        saved = _due(it, cfg.checkpoint.every, last)
        if saved:
            self._guarded(self.save)
        stop = [callback(algo, batch, metrics) for callback in self.callbacks].count(False) > 0 or timed_out
        if stop and cfg.checkpoint.every and not saved:  # a run stopped early can be resumed too
            self._guarded(self.save)
        bar.update(it - bar.n)
        shown = {k.removesuffix("/mean").rsplit("/", 1)[-1]: metrics[k] for k in algo.log_keys[:3] if k in metrics}
        bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
        return stop

    def _step(self, batches):
        """algorithm.step on the next batch (or the asynchronous pipeline's step), retried after
        a reward/cost function failure as configured."""
        attempts, prompts = 0, None
        asynchronous = self.config.asynchronous
        while True:
            try:
                if asynchronous.enabled:  # a failed step leaves its rollout first in the queue
                    return self.algorithm.asynchronous(asynchronous.max_staleness).step(batches)
                prompts = prompts if prompts is not None else next(batches)
                return self.algorithm.step(prompts)
            except Exception as error:
                failure = faults.reward_failure(error)
                if failure is None:
                    raise
                attempts += 1
                iteration = self.algorithm.iteration + 1
                if attempts > self.config.faults.reward_retries:
                    raise faults.RewardFunctionError(iteration, *failure, attempts) from error
                self.reward_retries += 1
                tqdm.write(
                    f"iteration {iteration}: the reward function {failure[0]} failed ({failure[1]}); "
                    f"retrying the iteration ({attempts}/{self.config.faults.reward_retries})"
                )

    def _guarded(self, work: Callable, *args):
        """`work(*args)`; when a worker group turns out dead, recover and rewind (raises _Rewound)."""
        try:
            return work(*args)
        except Exception as error:
            role = faults.dead_role(error)
            if role is None:
                failure = faults.reward_failure(error)  # e.g. while scoring the held-out answers
                if failure is not None:
                    raise faults.RewardFunctionError(self.algorithm.iteration, *failure, 1) from error
                raise
            self._recover(role, error)
            raise _Rewound() from error

    def _recover(self, role: str, error: BaseException) -> None:
        """Restart dead groups on their pools and reload every group from the last checkpoint."""
        limit = self.config.faults.max_recoveries
        failed = self.algorithm.iteration + 1
        while True:
            if self.recoveries >= limit:
                raise faults.RunStopped(
                    f"iteration {failed}: the worker group {role!r} died and the run has used its "
                    f"{limit} recoveries (faults.max_recoveries); {str(error).splitlines()[0]}"
                ) from error
            self.recoveries += 1
            seconds = time.time() - self.iteration_started
            self.faults.append({"iteration": failed, "error": str(error).splitlines()[0], "seconds": seconds})
            tqdm.write(
                f"iteration {failed}: the worker group {role!r} died ({str(error).splitlines()[0][:160]}); "
                f"recovery {self.recoveries}/{limit}: restarting it and reloading the last checkpoint"
            )
            try:
                how = self.config.faults
                if role != faults.RULE_REWARD_ROLE:  # (scorers are not a session's group)
                    self.session.recover(role, lost_host=how.lost_host, wait=how.rejoin_wait_s)
                for other in self.session.lost_roles():  # a lost host may have held other pools too
                    self.session.recover(other, lost_host=how.lost_host, wait=how.rejoin_wait_s)
                rule_reward.restart_dead_scorers()  # killed, or on a lost host
                state = self.checkpointer.restore(self.algorithm)
                break
            except Exception as again:  # another group found dead while restoring: recover it too
                role, error = faults.dead_role(again), again
                if role is None:
                    raise
        self.redo_until = max(self.redo_until, failed)
        tqdm.write(
            f"recovered: continuing from iteration {state['iteration']}; iterations "
            f"{state['iteration'] + 1}..{failed} are redone"
        )

    # ---- pieces a notebook or a callback may call too -------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Held-out greedy responses, scored by the task's reward (and cost): eval/score, eval/cost."""
        algo, cfg = self.algorithm, self.config
        sampling = replace(
            algo.config.sampling,
            greedy=True,
            n=1,
            max_new_tokens=cfg.evaluation.max_new_tokens or algo.config.sampling.max_new_tokens,
        )
        start = time.monotonic()
        with tags(step="eval", iteration=algo.iteration):
            env = getattr(algo.config, "env", None)  # multi-turn: episodes, scored by their environment
            gen = (
                algo.groups.actor.generate_episodes(self.eval_batch, env, sampling, algo.config.episode)
                if env is not None
                else algo.groups.actor.generate_sequences(self.eval_batch, sampling)
            )
            reward = algo.groups.reward.compute_reward(gen)
            cost = algo.groups.cost.compute_cost(gen) if algo.groups.cost is not None else None
            scored = reward.get()
            out = {"eval/score": float(scored["scores"].mean())}
            for key in (k for k in scored.keys() if k.startswith("reward/")):  # each reward's mean; rows fallen back
                out[f"eval/{key}"] = float(scored[key].sum() if key.endswith("/fallbacks") else scored[key].mean())
            if cost is not None:
                out["eval/cost"] = float(cost.get()["costs"].mean())
        out["timing_s/eval"] = time.monotonic() - start
        self.evaluations.append({"iteration": algo.iteration, **out})
        return out

    def memory(self, since: float = 0.0) -> dict[str, float]:
        """Each role's peak memory per process (rank), from the spans of calls started after
        `since`: `perf/peak_rss_gib/<role>/rank<r>` (and `perf/cuda_peak_gib/...` on GPUs)."""
        recent = itertools.takewhile(lambda r: r.start >= since, reversed(self.session.trace()))
        return memory_metrics(recent)

    def save(self) -> Path:
        """A whole-run checkpoint at the current iteration."""
        extra = {
            "recoveries": self.recoveries,
            "reward_retries": self.reward_retries,
            "batches_consumed": self._drawn(),
            "config": self.config.to_dict(),
        }
        return self.checkpointer.save(self.algorithm, self.algorithm.iteration, extra=extra)

    def result(self, started: float) -> RunResult:
        out = self.config.output_dir
        files = {"config": out / "config.yaml", "metrics": out / "metrics.jsonl"}
        for kind, path in (
            ("plan", out / "plan.yaml"),
            ("tensorboard", out / "tensorboard"),
            ("rollouts", out / "rollouts.jsonl"),
            ("trace", out / "trace.json"),
            ("spans", out / "trace.jsonl"),
            ("checkpoints", self.config.checkpoint_dir),
        ):
            if path.exists():
                files[kind] = path
        files |= self.exported
        return RunResult(
            out,
            files,
            self.algorithm.iteration if self.algorithm else 0,
            self.recoveries,
            self.reward_retries,
            self.history,
            self.evaluations,
            time.time() - started,
            self.faults,
        )

    def measured_iteration_s(self) -> float | None:
        """Median of the iterations' timing_s/step (None before the first)."""
        steps = sorted(row["timing_s/step"] for row in self.history if "timing_s/step" in row)
        if not steps:
            return None
        mid = len(steps) // 2
        return steps[mid] if len(steps) % 2 else (steps[mid - 1] + steps[mid]) / 2

    def _write_plan(self) -> None:
        """plan.yaml: the plan the run placed its models by (its YAML form: `placement.plan=<this
        file>` runs it again), where it came from, the estimate and, once iterations ran, the
        measured median iteration."""
        record = self.plan.to_dict()
        measured = self.measured_iteration_s()
        if measured is not None:
            record["measured_iteration_s"] = {"median": round(measured, 6), "iterations": len(self.history)}
        path = self.config.output_dir / "plan.yaml"
        path.write_text(yaml.safe_dump(record, sort_keys=False))

    def _plan_line(self) -> str:
        plan, measured = self.plan, self.measured_iteration_s()
        shown = f"{measured:.3f} s measured (median)" if measured is not None else "no iteration measured"
        return (
            f"plan {plan.name!r} ({plan.source}; {plan.cluster}): {plan.plan.describe()}; "
            f"{plan.estimated_iteration_s:.3f} s/iteration estimated, {shown}"
        )

    # ---- start and end ----------------------------------------------------------------------------
    def _prepare_output(self, out: Path) -> bool:
        """Make the output directory; True when this run resumes an earlier one there."""
        cfg = self.config
        latest = cfg.checkpoint_dir / "latest"
        resume = cfg.checkpoint.resume and latest.exists()
        out.mkdir(parents=True, exist_ok=True)
        if not resume:  # a fresh run: the previous run's files would mix with this one's
            for name in RUN_FILES:
                path = out / name
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
            if not cfg.checkpoint.directory:  # the run's own checkpoints folder
                shutil.rmtree(cfg.checkpoint_dir, ignore_errors=True)
            elif cfg.checkpoint_dir.exists():  # a folder of the user's: only what a run puts there
                for path in [*cfg.checkpoint_dir.glob("step-*"), latest]:
                    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return resume

    def _start(self, resume: bool) -> None:
        if resume:
            state = self.checkpointer.restore(self.algorithm)
            extra = state.get("extra", {})
            self.recoveries = int(extra.get("recoveries", 0))
            self.reward_retries = int(extra.get("reward_retries", 0))
            self.redo_until = last_logged_iteration(self.config.output_dir / "metrics.jsonl")
            print(f"resumed {self.config.name!r} from {self.checkpointer.latest()} at iteration {state['iteration']}")
        elif self.config.faults.max_recoveries:
            self.save()  # a death before the first periodic checkpoint can be recovered too

    def _finish(self, out: Path, started: float) -> None:
        session = self.session
        if session is None:
            return
        try:
            records = [r for r in session.trace() if r.start >= started]
            save_chrome_trace(records, out / "trace.json")
            save_records(records, out / "trace.jsonl")  # the spans whole: `python -m workbench app --run DIR`
        except Exception as error:  # the trace is a convenience: never hide the run's own error for it
            print(f"(no trace written: {type(error).__name__}: {error})", file=sys.stderr)
        if self.given_session is None:
            session.shutdown()
        else:
            session.clear(reason="the run ended (workbench.run.Runner releases its groups)")


def _due(iteration: int, every: int, last: int) -> bool:
    return bool(every) and (iteration % every == 0 or iteration == last)


def _describe(path: Path) -> str:
    if path.is_dir():
        entries = sorted(p.name for p in path.iterdir())
        return f"/  ({', '.join(entries[:4])}{', ...' if len(entries) > 4 else ''})"
    if path.suffix == ".jsonl":
        return f"  ({sum(1 for _ in path.open(encoding='utf-8'))} lines)"
    return f"  ({path.stat().st_size // 1024} KiB)" if path.exists() else ""


def run(config: RunConfig | str | Path, overrides: Iterable[str] = (), **kwargs: Any) -> RunResult:
    """Run a config (or a YAML file with overrides)."""
    if not isinstance(config, RunConfig):
        config = load_config(config, list(overrides))
    return Runner(config, **kwargs).run()


def main(argv: list[str]) -> None:
    """`python -m workbench run config.yaml [field=value ...]`."""
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: python -m workbench run CONFIG.yaml [dotted.field=value ...]\n"
            "  e.g. python -m workbench run configs/ppo.yaml iterations=20 sampling.n=4 actor.optim.lr=3e-5\n"
            "  configs/: ppo.yaml, ppo_planned.yaml, grpo.yaml, safe_rlhf.yaml, smollm2_grpo.yaml, smollm2_ppo.yaml\n"
            "  fields: workbench/run/config.py"
        )
        sys.exit(0 if argv else 2)
    try:
        config = load_config(argv[0], argv[1:])
    except ConfigError as error:  # a typo in a config or an override: say which, no traceback
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)
    run(config)
