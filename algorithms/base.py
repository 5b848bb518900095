"""What every algorithm shares: its settings, and the steps its recipe is written in.

An algorithm file (ppo.py, grpo.py, ...) subclasses `Algorithm` and writes `step()` (one
iteration) as a few step calls. Each step is also a method a notebook cell can call on its own:

    gen = algo.generate(prompts)                 # a DataFuture: returns at once
    batch = algo.collect(gen, algo.old_log_probs(gen), algo.reference(gen), algo.values(gen), algo.reward(gen))
    batch = algo.advantages(algo.shape_rewards(batch))   # driver-side numerics (algorithms.core)
    metrics = algo.finish(batch, critic=algo.update_critic(batch), actor=algo.update_actor(batch))

Remote steps return futures, which flow worker to worker; `collect` waits and joins them on
the driver. Estimators and losses are looked up in core's registries at each call. The steps,
their names (`timing_s/<name>`, the trace's `extra["step"]`) and what each produces are one
table, `workbench.steps`.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from algorithms import core
from algorithms.groups import Groups
from algorithms.guard import finite_batch
from algorithms.losses import ActorLoss, CriticLoss
from algorithms.metrics import data_metrics, format_line, throughput
from algorithms.pipeline import Rollout, RolloutPipeline
from workbench import checks, config_loader, steps
from workbench.agents.env import Environment
from workbench.clock import StepClock
from workbench.data.batch import Batch
from workbench.engines.multi_turn import EpisodeConfig
from workbench.engines.rollout import SamplingConfig, stream_seed
from workbench.errors import ConfigError
from workbench.models.load import resolve_dtype

_run_numbers = itertools.count(1)

OLD_LOG_PROB_SOURCES = ("auto", "recompute", "rollout")


@dataclass
class AlgoConfig:
    """Settings shared by the algorithms; each algorithm's config changes the defaults."""

    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(max_new_tokens=16))
    """Rollout settings (n samples per prompt, temperature, max_new_tokens, ...)."""
    estimator: str | Callable = "gae"
    """Advantage estimator: a name in core.ADVANTAGES, or the function itself."""
    estimator_args: dict = field(default_factory=dict)
    """Extra keyword values for the estimator (and the policy loss), by parameter name."""
    gamma: float = 1.0
    lam: float = 0.95
    norm_adv_by_std: bool = True
    policy_loss: str | Callable = "ppo"
    """A name in core.POLICY_LOSSES ("ppo", "gspo"), or the function itself."""
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    """PPO-style clip range below/above 1; None = the policy loss's own default (PPO 0.2,
    GSPO 3e-4 / 4e-4). A higher `clip_ratio_high` is DAPO's clip-higher."""
    clip_ratio_c: float | None = None
    """Dual-clip constant (e.g. 3.0); None = off."""
    loss_agg_mode: str = "token-mean"
    """One of core.LOSS_AGG_MODES."""
    entropy_coeff: float = 0.0
    kl_coef: float = 0.0
    """KL penalty folded into the reward, r_t - beta KL_t (PPO style); 0 = off."""
    kl_penalty: str = "k1"
    """Estimator for the in-reward KL: "k1", "k2", "k3" or "abs"."""
    kl_target: float | None = None
    """Adapt kl_coef (Ziegler et al.) so the mean KL per token (actor/reward_kl_penalty) nears this; None = fixed."""
    kl_horizon: int = 10000
    kl_loss_coef: float = 0.0
    """KL to the reference added to the actor loss (GRPO style); 0 = off."""
    kl_loss_type: str = "k3"
    cliprange_value: float | None = 0.5
    """Critic value clipping; None = plain MSE."""
    old_log_probs: str = "auto"
    """Where log pi_old comes from: "recompute" (a forward of the training engine over the
    sampled rows), "rollout" (the log-probs the rollout engine computed while sampling: no extra
    forward), or "auto" = "rollout" where that is exact — the update is on-policy (one epoch,
    one mini-batch per batch, so the ratio is 1 at its only step) and the rollout computes its
    log-probs like training does (HF rollout, fp32) — and "recompute" elsewhere."""
    env: Environment | None = None
    """Sample multi-turn episodes in this environment (the actor's generate_episodes: policy
    turns and tool observations, the observations masked out of the loss) instead of single
    responses; score them with workbench.workers.episode_reward.EpisodeReward as the reward."""
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    """Turn and token limits of an episode, when `env` is set."""

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Every field checked (again, for a config edited in place: Algorithm does so at each step)."""
        owner = type(self).__name__
        checks.of_type(owner, "sampling", self.sampling, SamplingConfig, "pass a SamplingConfig(...)")
        if self.env is not None:
            checks.of_type(owner, "env", self.env, Environment, "pass a workbench.agents.Environment, or None")
        checks.of_type(owner, "episode", self.episode, EpisodeConfig, "pass an EpisodeConfig(max_turns=...)")
        self.sampling.__post_init__()  # frozen, but a replaced field may bypass nothing: re-check
        for name, registry in (("estimator", core.ADVANTAGES), ("policy_loss", core.POLICY_LOSSES)):
            value = getattr(self, name)
            if not callable(value) and value not in registry:
                raise ConfigError(
                    f"{owner}.{name}", value, f"use one of {sorted(registry.entries)}, or pass the function itself"
                )
        checks.real(owner, "gamma", self.gamma, 0, 1, fix="use a discount in [0, 1]")
        checks.real(owner, "lam", self.lam, 0, 1, fix="use a GAE lambda in [0, 1]")
        for name in ("clip_ratio_low", "clip_ratio_high"):
            checks.real(
                owner,
                name,
                getattr(self, name),
                0,
                low_open=True,
                none_ok=True,
                fix="use a clip range > 0 (e.g. 0.2), or None for the loss's default",
            )
        checks.real(
            owner,
            "clip_ratio_c",
            self.clip_ratio_c,
            1,
            low_open=True,
            none_ok=True,
            fix="use a dual-clip constant > 1 (e.g. 3.0), or None for off",
        )
        checks.real(owner, "entropy_coeff", self.entropy_coeff, fix="use a finite number (0 = off)")
        checks.real(owner, "kl_coef", self.kl_coef, 0, fix="use a KL coefficient >= 0 (0 = off)")
        checks.real(owner, "kl_loss_coef", self.kl_loss_coef, 0, fix="use a KL-loss coefficient >= 0 (0 = off)")
        checks.real(
            owner, "kl_target", self.kl_target, 0, low_open=True, none_ok=True, fix="use a target KL > 0, or None"
        )
        checks.whole(owner, "kl_horizon", self.kl_horizon, fix="use a whole number of samples >= 1")
        checks.real(
            owner,
            "cliprange_value",
            self.cliprange_value,
            0,
            low_open=True,
            none_ok=True,
            fix="use a value clip range > 0, or None for plain MSE",
        )
        checks.of_type(owner, "estimator_args", self.estimator_args, dict, "pass a dict of keyword values")
        checks.one_of(owner, "old_log_probs", self.old_log_probs, OLD_LOG_PROB_SOURCES)
        checks.one_of(owner, "loss_agg_mode", self.loss_agg_mode, core.LOSS_AGG_MODES)
        if self.kl_target is not None:
            checks.real(
                owner,
                "kl_coef",
                self.kl_coef,
                0,
                low_open=True,
                fix=f"kl_target={self.kl_target} adapts kl_coef, which must start > 0",
            )
        for name in ("kl_penalty", "kl_loss_type"):
            checks.one_of(owner, name, getattr(self, name), sorted(core.KL_PENALTIES.entries))

    def settings(self) -> dict[str, Any]:
        """Every field by name, then estimator_args: what estimators and losses are bound from."""
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, **self.estimator_args}

    @classmethod
    def from_dict(cls, values: dict[str, Any]):
        """This config from a mapping (a YAML section, a dict in a cell): nested `sampling:` keys
        update this config's default sampling; an unknown or mistyped field is a ConfigError
        naming `<Config>.<dotted.field>` (and the nearest valid name), as in a headless run."""
        return config_loader.build(cls, values, cls.__name__)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | tuple[str, ...] = ()):
        """This config from a YAML file of its fields, with `dotted.field=value` overrides."""
        return cls.from_dict(config_loader.read(path, overrides))


class Algorithm:
    """The steps of an RLHF iteration over live worker groups; subclasses write `step` (one iteration)."""

    Config = AlgoConfig
    roles: tuple[str, ...] = ("actor", "reward")
    log_keys = ("critic/score/mean", "actor/pg_loss", "actor/entropy", "response_length/mean", "timing_s/step")

    def __init__(self, groups: Groups, config: AlgoConfig | None = None):
        self.groups, self.config = groups, config or self.Config()
        groups.require(type(self).__name__, *self.required_roles())
        cfg = self.config
        self._check_temperature()
        self.kl_ctl = (
            core.AdaptiveKL(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.kl_target else core.FixedKL(cfg.kl_coef)
        )
        self.run_name = f"{type(self).__name__}#{next(_run_numbers)}"
        """Tags this algorithm's trace spans (`extra["run"]`), told apart from other runs in one session."""
        self.clock = StepClock(self.run_name)
        self.reuse_rollout_log_probs = False  # decided per iteration, in generate()
        self.iteration = 0
        self.history: list[dict[str, float]] = []
        self.rollout_version = -1
        """The policy version the rollout group holds (Groups.rollout); -1: not pushed yet."""
        self.pipeline: RolloutPipeline | None = None
        """Generations launched ahead by `fit(..., asynchronous=True)`; kept between calls."""
        self._link: Any = None

    def required_roles(self) -> tuple[str, ...]:
        return self.roles

    # ---- run state (whole-run checkpoints: workbench.run.checkpoint) ---------------------------
    controllers: tuple[str, ...] = ("kl_ctl",)
    """Attributes holding driver-side controllers (dataclasses) that change as the run goes."""

    def state_dict(self) -> dict[str, Any]:
        """What the driver must keep for a run to continue exactly: the iteration (it also seeds
        each iteration's sampling stream), the metrics so far and the controllers' values."""
        state = {
            "iteration": self.iteration,
            "history": [dict(m) for m in self.history],
            **{name: dataclasses.asdict(getattr(self, name)) for name in self.controllers},
        }
        if self.pipeline is not None:  # rollouts generated ahead, with the versions that made them
            state["pipeline"] = self.pipeline.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [k for k in ("iteration", "history", *self.controllers) if k not in state]
        if missing:
            raise ConfigError(
                f"{type(self).__name__}.load_state_dict",
                sorted(state),
                f"missing {missing}: a state saved by another algorithm?",
            )
        self.iteration, self.history = int(state["iteration"]), [dict(m) for m in state["history"]]
        for name in self.controllers:
            setattr(self, name, type(getattr(self, name))(**state[name]))
        self.rollout_version = -1  # the rollout group gets the loaded weights before it generates
        self.pipeline = None
        if "pipeline" in state:
            self.pipeline = RolloutPipeline(self, state["pipeline"]["max_staleness"])
            self.pipeline.load_state_dict(state["pipeline"])

    def _check(self, prompts: Batch) -> None:
        """Before an iteration's remote work: the config (perhaps edited in place in a cell since
        the last step) and the groups' batch sizes against this iteration's rows."""
        self.config.__post_init__()  # the config class's own checks, subclass rules included
        self.groups.require(type(self).__name__, *self.required_roles())
        self._check_temperature()
        if not isinstance(prompts, Batch):
            return
        rows = len(prompts) * self.config.sampling.n
        for role in ("actor", "critic", "cost_critic"):
            check = getattr(getattr(getattr(self.groups, role), "config", None), "check_rows", None)
            if callable(check):
                check(rows, role)

    def _check_temperature(self) -> None:
        """Log-probs are computed at each group's ActorConfig.temperature and the loss's at the
        sampling temperature: different values would make every ratio and KL wrong."""
        sampling = self.config.sampling
        if sampling.greedy:
            return
        for role in ("actor", "reference"):
            worker_config = getattr(getattr(self.groups, role), "config", None)
            temperature = getattr(worker_config, "temperature", None)
            if temperature is not None and abs(temperature - sampling.temperature) > 1e-9:
                raise ValueError(
                    f"{type(self).__name__}: the {role} computes log-probs at ActorConfig.temperature="
                    f"{temperature} but samples are drawn at sampling.temperature={sampling.temperature}; "
                    f"set both to the same value (rebuild the {role} group, or change the sampling)"
                )

    # ---- remote steps: each returns a future at once (names: workbench.steps) -------------------
    def generate(
        self,
        prompts: Batch,
        sampling: SamplingConfig | None = None,
        *,
        step: str = steps.GEN.name,
        new_iteration: bool = True,
        stage: str | None = None,
    ):
        """Sample responses to `prompts`. By default an iteration starts here (see
        `start_iteration`); pass `new_iteration=False` for a further generation inside one
        (ReMax's greedy baseline: `step="gen_greedy"`)."""
        if stage is not None:  # the old keyword, under which only "gen" started an iteration
            step, new_iteration = _renamed_stage(stage), stage == steps.GEN.name
        if isinstance(prompts, Rollout):  # launched ahead (asynchronous fit): its result, pending
            if new_iteration:
                self.start_iteration(prompts.prompts, sampling, stale=prompts.version < self.iteration)
                result = prompts.result
                return result if isinstance(result, Batch) else self.clock.launch(step, result)
            prompts = prompts.prompts  # a further generation of the iteration (ReMax's baseline): now
        sampling = self._seeded(sampling or self.config.sampling, self.iteration)
        if new_iteration:
            self.start_iteration(prompts, sampling)
        return self.clock.launch(step, self._launch_generation(prompts, sampling))

    def _seeded(self, sampling: SamplingConfig, index: int) -> SamplingConfig:
        """Batch `index`'s own sampling stream: iterations must not repeat samples."""
        return sampling if sampling.seed is None else replace(sampling, seed=stream_seed(sampling.seed, index))

    def generator(self):
        """The group that generates: the rollout group when there is one (its weights brought
        up to date first), else the actor (its own rollout engine)."""
        self.sync_rollout()
        return self.groups.rollout if self.groups.rollout is not None else self.groups.actor

    def _launch_generation(self, prompts: Batch, sampling: SamplingConfig):
        """Responses, or multi-turn episodes when config.env is set."""
        group = self.generator()
        if self.config.env is not None:
            return group.generate_episodes(prompts, self.config.env, sampling, self.config.episode)
        return group.generate_sequences(prompts, sampling)

    def launch_rollout(self, prompts: Batch, index: int) -> Rollout:
        """Generate batch `index` of the run now, for an iteration to come (the asynchronous
        pipeline); checked on the driver first, as an iteration's generation is."""
        self._check(prompts)
        sampling = self._seeded(self.config.sampling, index)
        return Rollout(prompts, self._launch_generation(prompts, sampling), self.rollout_version, index)

    def sync_rollout(self) -> None:
        """Push the actor's weights to the rollout group (Groups.rollout) when it holds an older
        version; returns at once (the push runs after the calls queued on either group)."""
        if self.groups.rollout is None or self.rollout_version == self.iteration:
            return
        from workbench.workers.rollout_link import RolloutLink  # the worker stack, only when used

        link = self._link
        if link is None or not link.current() or link.rollout is not self.groups.rollout:
            link = self._link = RolloutLink(self.groups.actor, self.groups.rollout)
        link.push(self.iteration)
        self.rollout_version = self.iteration

    def start_iteration(self, prompts: Batch, sampling: SamplingConfig | None = None, stale: bool = False) -> None:
        """Before an iteration's remote work: check the config and batch sizes, drop whatever a
        failed iteration left on the clock, and decide where this iteration's log pi_old comes
        from (a `stale` batch, generated by an older policy, always recomputes it)."""
        sampling = sampling or self.config.sampling
        self._check(prompts)
        self.clock.reset()
        source = self.old_log_prob_source(len(prompts) * sampling.n)
        self.reuse_rollout_log_probs = source == "rollout" and not stale

    def old_log_probs(self, gen):
        """log pi_old of the sampled tokens, recomputed by the training forward (+ entropy);
        None when this iteration reuses the rollout's log-probs (see AlgoConfig.old_log_probs)."""
        if self.reuse_rollout_log_probs:
            return None
        return self.clock.launch(steps.OLD_LOG_PROB.name, self.groups.actor.compute_log_prob(gen), gen)

    def old_log_prob_source(self, rows: int) -> str:
        """ "rollout" or "recompute" for an iteration of `rows` responses, per config.old_log_probs;
        asking for "rollout" where it would not be exact is refused here, before remote work."""
        mode = self.config.old_log_probs
        if mode == "recompute":
            return mode
        actor = getattr(self.groups.actor, "config", None)
        generator = getattr(self.groups.rollout, "config", None) or actor  # whose log-probs the rows carry
        if actor is None or not hasattr(actor, "epochs"):
            why = "the actor's config is unknown (not a workbench ActorRolloutRefWorker group)"
        elif actor.epochs != 1:
            why = (
                f"ActorConfig.epochs={actor.epochs} "
                "(after the first pass pi_old is no longer the sampling policy's copy)"
            )
        elif actor.mini_batch_size < rows:
            why = (
                f"ActorConfig.mini_batch_size={actor.mini_batch_size} splits the {rows} rows of a batch into "
                f"several optimizer steps"
            )
        elif mode == "auto" and (
            generator.rollout != "hf" or resolve_dtype(generator.load.dtype, generator.load.device) != torch.float32
        ):
            why = "the rollout's log-probs are not computed like the training forward's (HF rollout in fp32)"
        else:
            return "rollout"
        if mode == "rollout":
            raise ValueError(
                f"{type(self).__name__}: old_log_probs='rollout' is exact only for an on-policy update, but {why}; "
                f"set old_log_probs='recompute' (or 'auto'), or make the update on-policy "
                f"(epochs=1, mini_batch_size >= {rows})"
            )
        return "recompute"

    def reference(self, gen):
        return self.clock.launch(steps.REF.name, self.groups.reference.compute_ref_log_prob(gen), gen)

    def values(self, gen):
        return self.clock.launch(steps.VALUES.name, self.groups.critic.compute_values(gen), gen)

    def reward(self, gen, *, step: str = steps.REWARD.name, stage: str | None = None):
        step = _renamed_stage(stage) if stage is not None else step
        return self.clock.launch(step, self.groups.reward.compute_reward(gen), gen)

    def update_critic(
        self, batch: Batch, critic=None, loss=None, *, step: str = steps.UPDATE_CRITIC.name, stage: str | None = None
    ):
        step = _renamed_stage(stage) if stage is not None else step
        finite_batch(batch, before=step)
        loss = loss or CriticLoss(self.config.cliprange_value, self.config.loss_agg_mode)
        return self.clock.launch(step, (critic or self.groups.critic).update_critic(batch, loss))

    def update_actor(self, batch: Batch, loss=None, *, step: str = steps.UPDATE_ACTOR.name, stage: str | None = None):
        step = _renamed_stage(stage) if stage is not None else step
        finite_batch(batch, before=step)
        return self.clock.launch(step, self.groups.actor.update_actor(batch, loss or self.actor_loss()))

    # ---- driver-side steps ----------------------------------------------------------------------
    def collect(self, *parts) -> Batch:
        """Wait for the given results and join them into one Batch on the driver."""
        self.clock.wait()
        batch = parts[0].get() if hasattr(parts[0], "get") else parts[0]
        for part in parts[1:]:
            if part is not None:
                batch = batch.union(part.get() if hasattr(part, "get") else part)
        if self.reuse_rollout_log_probs and "old_log_probs" not in batch:
            batch["old_log_probs"] = batch["rollout_log_probs"]
        for key in ("scores", "costs"):  # rule rewards give one number per sequence
            if key in batch and f"token_level_{key}" not in batch:
                batch[f"token_level_{key}"] = core.last_token_scores(batch[key], batch["response_mask"])
        return batch

    def shape_rewards(self, batch: Batch, share: float = 1.0) -> Batch:
        """token_level_rewards = scores - share * beta * KL(old || ref) when kl_coef > 0 (PPO
        style); the per-token KL is kept as token_level_kl."""
        with self.clock.measure(steps.REWARD_SHAPING.name):
            if self.kl_ctl.value:
                rewards, kl = core.kl_in_reward(
                    batch["token_level_scores"],
                    batch["old_log_probs"],
                    batch["ref_log_probs"],
                    batch["response_mask"],
                    share * self.kl_ctl.value,
                    self.config.kl_penalty,
                )
                batch["token_level_rewards"], batch["token_level_kl"] = rewards, kl
                mean_kl = core.mean_token_kl(kl, batch["response_mask"])
                batch.info["actor/reward_kl_penalty"] = mean_kl
                batch.info["actor/reward_kl_penalty_coeff"] = self.kl_ctl.value
                self.kl_ctl.update(mean_kl, len(batch))
            else:
                batch["token_level_rewards"] = batch["token_level_scores"]
        return batch

    def advantages(self, batch: Batch, estimator: str | Callable | None = None) -> Batch:
        """advantages and returns from the estimator registered under config.estimator *now*."""
        name = estimator or self.config.estimator
        fn = core.ADVANTAGES.get(name)
        with self.clock.measure(steps.ADV.name):
            batch["advantages"], batch["returns"] = core.call(
                fn, batch, self.config.settings(), what=f"advantage estimator {name!r}"
            )
        return batch

    def actor_loss(self) -> ActorLoss:
        cfg = self.config
        return ActorLoss(
            policy=core.POLICY_LOSSES.get(cfg.policy_loss),
            settings={k: v for k, v in cfg.settings().items() if isinstance(v, (int, float, str, type(None)))},
            temperature=cfg.sampling.temperature if not cfg.sampling.greedy else 1.0,
            entropy_coeff=cfg.entropy_coeff,
            kl_coef=cfg.kl_loss_coef,
            kl_penalty=core.KL_PENALTIES.get(cfg.kl_loss_type),
            loss_agg_mode=cfg.loss_agg_mode,
        )

    def finish(self, batch: Batch, **updates) -> dict[str, float]:
        """Wait for the updates (by role: actor=..., critic=...); this iteration's metrics, also
        appended to `history`. Other roles' metrics are renamed under their role (cost_critic/...)."""
        self.clock.wait()
        metrics = {}
        for role, update in updates.items():
            for key, value in update.get().items():
                head, _, rest = key.partition("/")
                metrics[key if role in ("actor", "critic") or not rest else f"{role}/{rest}"] = value
        metrics |= {k: v for k, v in batch.info.items() if "/" in k and isinstance(v, float)}
        metrics |= data_metrics(batch)
        metrics |= self.clock.report()
        metrics["perf/throughput"] = throughput(metrics)
        self.iteration += 1
        metrics["iteration"] = float(self.iteration)
        self.history.append(metrics)
        return metrics

    # ---- whole iterations -----------------------------------------------------------------------
    def step(self, prompts: Batch) -> tuple[Batch, dict[str, float]]:
        raise NotImplementedError

    def fit(
        self,
        prompts: Iterable[Batch],
        iterations: int,
        log: Callable[[str], None] | None = print,
        callbacks: Iterable[Callable] = (),
        *,
        asynchronous: bool = False,
        max_staleness: int = 1,
    ) -> list[dict]:
        """`iterations` steps over the prompt batches (cycled), logging one line each.

        callbacks: called after every step as `callback(algorithm, batch, metrics)`, e.g. a
            `widgets.MetricsDashboard` or `widgets.LiveTimeline`; one that returns False stops
            the loop after that step. Pass `log=None` to silence the line.
        asynchronous: generate the next batches on the rollout group (Groups.rollout) while the
            actor trains on this one, each at most `max_staleness` policy versions old
            (algorithms.pipeline; 0 = the synchronous run). The launched generations are kept
            between calls (and in checkpoints): the next fit trains on them first."""
        callbacks = list(callbacks)
        for callback in callbacks:
            if not callable(callback):
                raise TypeError(
                    f"fit: callbacks must be callables callback(algorithm, batch, metrics); got {callback!r}"
                )
        step: Callable[[Any], tuple[Batch, dict]] = self.step
        batches = _epochs(prompts)
        if asynchronous:
            pipeline = self.asynchronous(max_staleness)
            step, batches = (lambda draw: pipeline.step(draw)), itertools.repeat(iter(batches))
        metrics = []
        for prompt_batch in itertools.islice(batches, iterations):
            batch, m = step(prompt_batch)
            metrics.append(m)
            if log:
                log(format_line(self.iteration, m, self.log_keys))
            if [callback(self, batch, m) for callback in callbacks].count(False):
                break
        return metrics

    def asynchronous(self, max_staleness: int = 1) -> RolloutPipeline:
        """The pipeline that launches generations ahead (kept between fits, restored from
        checkpoints); a different bound first trains on what was launched under the old one."""
        if self.pipeline is None or self.pipeline.max_staleness != max_staleness:
            pipeline = RolloutPipeline(self, max_staleness)
            if self.pipeline is not None:  # already launched: trained first, under the new bound
                pipeline.queue, pipeline.launched = self.pipeline.queue, self.pipeline.launched
            self.pipeline = pipeline
        return self.pipeline

    def fit_background(
        self, prompts: Iterable[Batch], iterations: int, callbacks: Iterable[Callable] = ()
    ) -> BackgroundFit:
        """`fit` in a thread: the notebook's kernel stays free (look at the trace, the batch, the
        dashboard) while the iterations run. Returns at once; `.wait()` gives the metrics."""
        return BackgroundFit(self, prompts, iterations, list(callbacks))

    def evaluate(self, prompts: Batch, reward=None, max_new_tokens: int | None = None) -> float:
        """Mean score of greedy responses (e.g. exact-match accuracy on held-out prompts); `reward`
        may be any scorer, e.g. a RuleReward(cost_fn, output_key="costs") for the mean cost."""
        sampling = replace(
            self.config.sampling, greedy=True, n=1, max_new_tokens=max_new_tokens or self.config.sampling.max_new_tokens
        )
        gen = self.generator().generate_sequences(prompts, sampling)
        scorer = reward or self.groups.reward
        out = scorer.compute_reward(gen).get()
        return float(out[getattr(scorer, "output_key", "scores")].mean())


class BackgroundFit:
    """A `fit` running in a thread. `history` fills in as iterations finish; `stop()` ends the
    run after the current iteration; `wait()` returns the metrics (or raises the run's error)."""

    def __init__(self, algorithm: Algorithm, prompts: Iterable[Batch], iterations: int, callbacks: list[Callable]):
        self.history: list[dict] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()

        def keep(algo, batch, metrics):
            self.history.append(metrics)
            return not self._stop.is_set()

        def run():
            try:
                algorithm.fit(prompts, iterations, log=None, callbacks=[*callbacks, keep])
            except BaseException as e:  # handed to wait()
                self.error = e

        self._thread = threading.Thread(target=run, name=f"fit {type(algorithm).__name__}", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()

    def wait(self, timeout: float | None = None) -> list[dict]:
        self._thread.join(timeout)
        if not self.done:
            raise TimeoutError(f"fit still running after {timeout} s ({len(self.history)} iterations done)")
        if self.error is not None:
            raise self.error
        return self.history

    def __repr__(self) -> str:
        return f"BackgroundFit({len(self.history)} iterations done{', finished' if self.done else ''})"


def _renamed_stage(stage: str) -> str:
    """The step named by the deprecated `stage=` keyword."""
    warnings.warn(
        "the stage= keyword of Algorithm's step methods is now step= (generate: also new_iteration=)",
        DeprecationWarning,
        stacklevel=3,
    )
    return stage


def _epochs(prompts: Iterable[Batch]):
    """Iterate `prompts` again and again (a PromptLoader reshuffles on each pass)."""
    while True:
        empty = True
        for batch in prompts:
            empty = False
            yield batch
        if empty:
            raise ValueError("fit: the prompt iterable is empty")
