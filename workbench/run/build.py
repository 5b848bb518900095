"""From a RunConfig to live pieces: the starting model, the prompt data, the worker groups on
their pools, and the algorithm that drives them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from algorithms import ALGORITHMS, Algorithm, Groups
from workbench.data import arithmetic
from workbench.data.prompts import (
    PromptDataError,
    PromptLoader,
    load_prompts,
    prompt_identity,
    split_held_out,
    tokenize_prompts,
)
from workbench.data.rewards import RewardDefinitionError, RewardSet
from workbench.data.tasks import Task, get_task
from workbench.deploy import deploy_calls, deploy_plan
from workbench.engines.rollout import SamplingConfig
from workbench.errors import ConfigError
from workbench.planner import (
    Dataflow,
    Evaluation,
    ExecutionPlan,
    Plan,
    PlanEvaluator,
    PlanFormatError,
    Problem,
    Workload,
    automap,
    search,
    set_partitions,
    specs_from_models,
)
from workbench.planner.call_plan_io import execution_plan_from_dict, execution_plan_to_dict
from workbench.planner.clusters import cluster_preset
from workbench.planner.derive import dataflow_preset
from workbench.planner.measured import estimated_call_seconds
from workbench.planner.plan_io import plan_from_dict, plan_to_dict
from workbench.run.config import FROM_MODEL, RunConfig
from workbench.session import Session
from workbench.workers.actor import ActorRolloutRefWorker
from workbench.workers.critic import CriticWorker
from workbench.workers.episode_reward import EpisodeReward
from workbench.workers.joint_reward import JointReward
from workbench.workers.judge import DEFAULT_TEMPLATE, JudgeConfig, JudgeWorker
from workbench.workers.rule_reward import RuleReward


def model_dir(config: RunConfig) -> Path:
    """The policy's directory: model.path, or the arithmetic kit's starting policy (made once, cached)."""
    if config.model.path:
        return Path(config.model.path).expanduser()
    from workbench.stages.arithmetic_policy import DEFAULT_CACHE, arithmetic_policy

    return arithmetic_policy(
        config.model.cache_dir or DEFAULT_CACHE,
        size=config.model.tiny_size,
        sft_steps=config.model.sft_steps,
        digits=config.data.arithmetic.digits,
    )


def prompt_rows(config: RunConfig) -> tuple[list[dict], list[dict]]:
    """Training and held-out rows (prompt, ground_truth and the source's other columns): from
    files or datasets, from reasoning-gym, or generated arithmetic problems put to the model the
    task's way (text or chat). No training row shares a prompt with a held-out one (generated
    held-out problems may be drawn one digit longer: data.held_out="harder")."""
    data = config.data
    if data.source == "reasoning_gym":
        return reasoning_gym_rows(config)
    if data.train_file:
        train = _read(data.train_file, data, data.train_split, "data.train_file")
        if data.eval_file:
            return train, _read(data.eval_file, data, data.eval_split, "data.eval_file")
        try:
            return split_held_out(train, data.eval_fraction, seed=data.seed)
        except PromptDataError as error:
            raise ConfigError("data.eval_fraction", data.eval_fraction, str(error)) from None
    put = task_of(config).prompt
    held_out = _read(data.eval_file, data, data.eval_split, "data.eval_file") if data.eval_file else None
    if held_out is None:
        difficulty = arithmetic.harder(data.arithmetic) if data.held_out == "harder" else data.arithmetic
        problems = arithmetic.generate(difficulty, data.eval_size, seed=data.seed + 1)
        held_out = [{"prompt": put(p), "ground_truth": p.ground_truth} for p in problems]
    seen = {prompt_identity(row["prompt"]) for row in held_out}
    train = [
        {"prompt": put(p), "ground_truth": p.ground_truth}
        for p in arithmetic.generate(data.arithmetic, data.train_size, seed=data.seed)
        if prompt_identity(put(p)) not in seen
    ]
    if not train:
        raise ConfigError(
            "data.train_size",
            data.train_size,
            "every generated problem is also held out; "
            "draw more (data.train_size) or harder ones (data.arithmetic.digits)",
        )
    return train, held_out


def _read(path: str, data, split: str, where: str) -> list[dict]:
    try:
        return load_prompts(path, data.columns or None, split=split)
    except PromptDataError as error:
        raise ConfigError(where, path, str(error)) from None


def task_of(config: RunConfig) -> Task:
    try:
        return get_task(config.data.task)
    except KeyError as error:
        raise ConfigError("data.task", config.data.task, str(error.args[0])) from None


def reasoning_gym_rows(config: RunConfig) -> tuple[list[dict], list[dict]]:
    """data.source=reasoning_gym: `eval_size` held-out and `train_size` training questions of the
    dataset `name`, one draw (seed `seed`; training questions also held out are dropped), as chat
    prompts, each row keeping `question` and `metadata` for the dataset's own scorer."""
    import reasoning_gym

    data = config.data

    def draw(size: int, seed: int) -> list[dict]:
        try:
            entries = reasoning_gym.create_dataset(data.name, size=size, seed=seed, **data.options)
        except Exception as error:  # an unknown name or setting: reasoning-gym's own words
            where = "data.name" if "not registered" in str(error) else "data.options"
            raise ConfigError(where, data.name, str(error)) from None
        system = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        return [
            {
                "prompt": [*system, {"role": "user", "content": e["question"]}],
                "ground_truth": str(e["answer"]),
                "question": e["question"],
                "metadata": e["metadata"],
                "data_source": f"reasoning_gym/{data.name}",
            }
            for e in entries
        ]

    # One draw, split: reasoning-gym makes item i from seed + i, so two draws with nearby seeds
    # share items (seed + 1's item i is seed's item i + 1).
    rows = draw(data.eval_size + data.train_size, data.seed)
    held_out = rows[: data.eval_size]
    seen = {row["question"] for row in held_out}
    train = [row for row in rows[data.eval_size :] if row["question"] not in seen]
    if not train:
        raise ConfigError("data.train_size", data.train_size, "every training question is also held out: draw more")
    return train, held_out


def prompt_data(config: RunConfig, tokenizer) -> tuple[PromptLoader, Any]:
    """The training loader and the held-out prompts as one Batch."""
    train, held_out = prompt_rows(config)
    loader_cfg = config.data.loader
    loader = PromptLoader(train, tokenizer, loader_cfg)
    eval_batch = tokenize_prompts(held_out, tokenizer, loader_cfg.max_prompt_length, loader_cfg.overlong)
    return loader, eval_batch


class TaskCost:
    """fn(text, truth) -> cost for RuleReward: a task's cost function, with the run's CostConfig
    bound where it takes one (the arithmetic task's). It holds the function itself, not the
    task's name: a scoring process knows only the built-in tasks."""

    def __init__(self, cost, cost_config=None):
        self.cost, self.cost_config = cost, cost_config
        self.__name__ = f"{getattr(cost, '__name__', 'cost')}"

    def __call__(self, response: str, truth: str) -> float:
        return self.cost(response) if self.cost_config is None else self.cost(response, self.cost_config)


def rewards(config: RunConfig) -> RewardSet:
    """The run's reward functions (data.rewards, else the task's or reasoning-gym's), loaded and
    checked on the driver: a file, module or signature that does not work is a ConfigError here."""
    data = config.data
    given = [r if isinstance(r, str) else dataclasses.asdict(r) for r in data.rewards]
    if not given:
        given = ["reasoning_gym"] if data.source == "reasoning_gym" else [{"function": task_of(config).score}]
    try:
        return RewardSet.of(given, where="data.rewards")
    except RewardDefinitionError as error:
        raise ConfigError("data.rewards", [str(r) for r in data.rewards], str(error)) from None


def cost(config: RunConfig) -> RewardSet:
    """The run's Safe-RLHF cost: data.cost_function, else the task's."""
    data = config.data
    try:
        if data.cost_function:
            return RewardSet.of({"function": data.cost_function, "name": "cost"}, where="data.cost_function")
    except RewardDefinitionError as error:
        raise ConfigError("data.cost_function", data.cost_function, str(error)) from None
    task = task_of(config)
    if task.cost is None:
        raise ConfigError(
            "data.cost_function",
            "",
            f"{config.algorithm_name} needs a cost and the task {task.name!r} has none: give data.cost_function",
        )
    bound = TaskCost(task.cost, data.cost if task.name == "arithmetic" else None)
    return RewardSet.of({"function": bound, "name": "cost"})


def required_roles(config: RunConfig) -> tuple[str, ...]:
    """The roles the configured algorithm needs (GRPO, e.g., needs a reference only with a KL loss)."""
    probe = object.__new__(ALGORITHMS[config.algorithm_name])
    probe.config = config.algorithm
    return probe.required_roles()


def algorithm_config(config: RunConfig):
    """The algorithm's config with the run's sampling (checked again: GRPO wants n >= 2, ...)."""
    try:
        return replace(config.algorithm, sampling=config.sampling)
    except ConfigError as error:  # named by its run-config field
        owner, _, rest = error.where.partition(".")
        where = rest if rest.startswith("sampling.") else f"algorithm.{rest or owner}"
        raise ConfigError(where, error.value, error.fix) from None


def devices_needed(config: RunConfig, plan: RunPlan | CallRunPlan | None = None) -> int:
    if plan is not None:
        return plan.n_devices
    critic = "critic" in required_roles(config) and config.placement.critic_devices
    place = config.placement
    judge = config.data.judge.devices if config.data.judge is not None else 0
    return place.actor_devices + (place.critic_devices if critic else 0) + place.rollout_devices + judge


def critic_path(config: RunConfig, policy: Path) -> str:
    """The critics' starting directory: critic.model_path, else model.critic_path, else the policy's."""
    if config.critic.model_path != FROM_MODEL:
        return config.critic.model_path
    return config.model.critic_path or str(policy)


def planner_models(config: RunConfig, policy: Path) -> dict[str, tuple[str, int, bool]]:
    """What the planner needs to know of each model role of the run: (model directory, LoRA rank,
    value head). The rank is the actor's / critics' `lora.rank` (0: every weight trains, or a
    frozen model), so `workbench.planner.specs_from_models` gives ModelSpecs whose memory
    estimate keeps gradients and Adam states for the adapters alone and whose weight syncs move
    just them. The reference is the frozen policy (under actor LoRA it lives in the actor's
    module, adapters off). Plain values, which the planner reads without knowing the run."""
    rank = lambda lora: lora.rank if lora is not None else 0  # noqa: E731
    actor_path = str(policy) if config.actor.model_path == FROM_MODEL else config.actor.model_path
    roles = required_roles(config)
    models = {"actor": (actor_path, rank(config.actor.lora), False)}
    if "reference" in roles:
        models["reference"] = (actor_path, 0, False)
    for role in ("critic", "cost_critic"):
        if role in roles:
            models[role] = (critic_path(config, policy), rank(config.critic.lora), True)
    return models


def algorithm(
    config: RunConfig, session: Session, policy: Path, plan: RunPlan | CallRunPlan | None = None
) -> Algorithm:
    """Pools and groups per the placement (or per `plan`, from `run_plan`), the rule reward
    (and cost), and the algorithm."""
    roles, place = required_roles(config), config.placement
    timeout = config.data.reward_timeout
    groups = Groups(reward=EpisodeReward() if config.data.environment else RuleReward(rewards(config), timeout=timeout))
    if "cost" in roles:
        groups.cost = RuleReward(cost(config), timeout=timeout, output_key="costs")

    algo_config = algorithm_config(config)
    if config.data.environment:
        algo_config = replace(algo_config, env=environment_of(config))
    actor_config = replace(
        config.actor,
        model_path=str(policy) if config.actor.model_path == FROM_MODEL else config.actor.model_path,
        reference="reference" in roles,
        temperature=config.actor.temperature if config.sampling.greedy else config.sampling.temperature,
    )
    if isinstance(plan, CallRunPlan):
        critic_config = replace(config.critic, model_path=critic_path(config, policy))
        workers = {"actor": (ActorRolloutRefWorker, replace(actor_config, reference=False))}
        if "reference" in roles:  # a group of its own: the plan may put its call anywhere
            reference = replace(actor_config, train=False, rollout=None, reference=True)
            workers["reference"] = (ActorRolloutRefWorker, reference)
        workers |= {role: (CriticWorker, critic_config) for role in ("critic", "cost_critic") if role in roles}
        for role, handle in deploy_calls(plan.plan, session, workers, plan.dataflow).items():
            setattr(groups, role, handle)
        return ALGORITHMS[config.algorithm_name](groups, algo_config)
    if plan is not None:
        critic_config = replace(config.critic, model_path=critic_path(config, policy))
        workers: dict[str, tuple[type, Any]] = {"actor": (ActorRolloutRefWorker, actor_config)}
        workers |= {role: (CriticWorker, critic_config) for role in ("critic", "cost_critic") if role in roles}
        for role, group in deploy_plan(plan.deployable(), session, workers).items():
            setattr(groups, role, group)
        if "reference" in roles:
            groups.reference = groups.actor  # the reference copy lives in the actor's processes
        return ALGORITHMS[config.algorithm_name](groups, algo_config)
    actor_pool = pool_of(session, config, "actor", place.actor_devices)
    critics: dict[str, tuple[type, Any]] = {}
    if "critic" in roles:
        critic_config = replace(config.critic, model_path=critic_path(config, policy))
        critics = {role: (CriticWorker, critic_config) for role in ("critic", "cost_critic") if role in roles}
    beside_rollout = critics and not place.critic_devices and place.critic_beside == "rollout"
    if place.rollout_devices:  # generation on devices of its own: the actor only trains
        rollout_config = replace(actor_config, train=False, reference=False, rollout=actor_config.rollout or "hf")
        rollout_pool = pool_of(session, config, "rollout", place.rollout_devices)
        # The critics may share the rollout's processes: they then train while the actor does.
        fused = session.fused(
            rollout_pool, rollout=(ActorRolloutRefWorker, rollout_config), **(critics if beside_rollout else {})
        )
        for role, group in fused.items():
            setattr(groups, role, group)
        actor_config = replace(actor_config, rollout=None)
    groups.actor = session.group("actor", ActorRolloutRefWorker, actor_pool, actor_config)
    if "reference" in roles:
        groups.reference = groups.actor  # the reference copy lives in the actor's processes
    if critics and not beside_rollout:
        pool = pool_of(session, config, "critic", place.critic_devices) if place.critic_devices else actor_pool
        for role, group in session.fused(pool, **critics).items():
            setattr(groups, role, group)
    judge = config.data.judge
    if judge is not None:
        pool = pool_of(session, config, "judge", judge.devices) if judge.devices else actor_pool
        group = session.fused(pool, reward=(JudgeWorker, judge_config(config, policy)))["reward"]
        scorers = [("judge", judge.weight, group)]
        if config.data.rewards:  # rule rewards beside the judge, each with its own weight
            scorers.append((groups.reward.name, 1.0, groups.reward))  # one function: reward/<its name>
        groups.reward = JointReward(scorers)
    return ALGORITHMS[config.algorithm_name](groups, algo_config)


def pool_of(session: Session, config: RunConfig, name: str, devices: int):
    """The run's pool `name`_pool: on placement.hosts[name] when given (its devices spread
    evenly over them), else filling nodes in order."""
    hosts = config.placement.hosts.get(name, [])
    if len(hosts) > 1:
        return session.pool(f"{name}_pool", [devices // len(hosts)] * len(hosts), hosts=hosts)
    return session.pool(f"{name}_pool", devices, hosts=hosts)


def judge_config(config: RunConfig, policy: Path) -> JudgeConfig:
    """data.judge as the judge group's config (greedy verdicts; the policy's model by default)."""
    judge = config.data.judge
    assert judge is not None
    try:
        return JudgeConfig(
            model_path=judge.model_path or str(policy),
            template=judge.template or DEFAULT_TEMPLATE,
            verdict=judge.verdict,
            fallback=judge.fallback,
            system=judge.system,
            max_prompt_length=judge.max_prompt_length,
            sampling=SamplingConfig(max_new_tokens=judge.max_new_tokens, greedy=True),
        )
    except ConfigError as error:  # named by its run-config field
        raise ConfigError(f"data.judge.{error.where.rpartition('.')[2]}", error.value, error.fix) from None


def environment_of(config: RunConfig):
    """data.environment, made with its options (on the driver: a bad reference is refused here)."""
    from workbench.agents.skyrl import environment

    try:
        return environment(config.data.environment, **config.data.environment_options)
    except ConfigError as error:
        raise ConfigError("data.environment", config.data.environment, error.fix) from None
    except TypeError as error:  # options the environment does not take
        raise ConfigError("data.environment_options", config.data.environment_options, str(error)) from None


# ---- placement by a planner plan ---------------------------------------------------------------
AUTOMAP = "automap"
SEARCH = "search"
PER_CALL_KEYS = ("calls", "layouts")
"""Keys of a per-call (ReaLHF) execution plan: `calls:` (call_plan_io's form) runs; `layouts:` is not
a form any writer makes."""


@dataclass
class RunPlan:
    """The plan a run places its models by, and where it came from."""

    plan: Plan
    source: str
    """"automap", "inline" (written in the run config) or the YAML file's path."""
    cluster: str
    """The cluster the plan was priced on: the calibrated local cluster (and its file) or the preset."""

    @property
    def name(self) -> str:
        """The plan's `name` where it was given one, else where it came from."""
        return self.plan.stats.get("name") or self.source

    @property
    def n_devices(self) -> int:
        return max(s.first_device + s.n_devices for s in self.plan.sets)

    @property
    def estimated_iteration_s(self) -> float:
        return self.plan.iteration_time

    def to_dict(self) -> dict[str, Any]:
        """plan.yaml: the plan's YAML form, with where it came from and the estimate per call."""
        return {
            "source": self.source,
            "cluster": self.cluster,
            **plan_to_dict(self.plan, self.name),
            "estimated_call_s": {k: round(v, 6) for k, v in self.plan.call_times.items()},
        }

    def deployable(self) -> Plan:
        """The plan without the reference, which the run keeps in the actor's processes (as the
        hand-written placement does); `run_plan` checked it shares the actor's set and layout."""
        sets = []
        for s in self.plan.sets:
            models = tuple(m for m in s.models if m != "reference")
            if models:
                sets.append(
                    dataclasses.replace(
                        s, models=models, assignments={m: a for m, a in s.assignments.items() if m in models}
                    )
                )
        return dataclasses.replace(self.plan, sets=tuple(sets))


@dataclass
class CallRunPlan:
    """A per-call (ReaLHF) plan a run places its calls by (`calls:`), priced by PlanEvaluator."""

    plan: ExecutionPlan
    dataflow: Dataflow
    estimate: Evaluation
    source: str
    cluster: str
    given_name: str = ""

    @property
    def name(self) -> str:
        return self.given_name or self.source

    @property
    def n_devices(self) -> int:
        return max(mesh.first + mesh.size for mesh, _ in self.plan.layouts.values())

    @property
    def estimated_iteration_s(self) -> float:
        return self.estimate.time

    @property
    def call_times(self) -> dict[str, float]:
        """Estimated seconds of each call in the first iteration, as the driver sees it (its
        dispatch included; a parameter reallocation before it is a task of its own)."""
        return estimated_call_seconds(self.estimate)

    def to_dict(self) -> dict[str, Any]:
        """plan.yaml: the plan's `calls:` form, with where it came from and the estimates."""
        return {
            "source": self.source,
            "cluster": self.cluster,
            **execution_plan_to_dict(self.plan, self.name),
            "estimated_iteration_s": round(self.estimated_iteration_s, 6),
            "estimated_call_s": {k: round(v, 6) for k, v in self.call_times.items()},
        }


def run_workload(config: RunConfig, prompt_width: float | None = None) -> Workload:
    """The planner's workload of one iteration of this run: prompts per batch, padded prompt
    length (`prompt_width`, the loader's mean Batch width, when known; else the most a Batch
    may have), response length, samples per prompt, epochs, mini-batches and micro-batch size
    of the actor's update; FSDP-sharded workers ("full"); whether they checkpoint activations;
    how the actor's switch moves weights, how a rollout group and a replica take them (by the
    trainers' backends), and how the reference keeps its weights."""
    return Workload(
        batch_size=config.data.loader.batch_size,
        prompt_len=max(1, round(prompt_width)) if prompt_width else config.data.loader.max_prompt_length,
        max_new_tokens=config.sampling.max_new_tokens,
        n=config.sampling.n,
        epochs=config.actor.epochs,
        mini_batch_size=config.actor.mini_batch_size,
        micro_batch_size=config.actor.micro_batch_size,
        param_sharding="full",
        # the papers' default (True) is not the workers'
        gradient_checkpointing=config.actor.load.gradient_checkpointing,
        transition_executor=config.actor.transition_executor,
        rollout_weights=config.algorithm.rollout_weights,  # type: ignore[arg-type]  # checked by AlgoConfig
        frozen_keep=config.actor.reference_keep,  # type: ignore[arg-type]  # checked by ActorConfig
        # the homes reallocation cannot read (rollout_link.reallocatable): their copies take the broadcast
        broadcast_homes=("actor",) * (config.actor.backend != "fsdp")
        + ("critic", "cost_critic") * (config.critic.backend == "deepspeed"),
    )


def run_dataflow(config: RunConfig, roles: tuple[str, ...] | list[str]) -> Dataflow:
    """The algorithm's dataflow with only the calls of the worker models the run starts
    (`roles`): the rule reward and cost run on the driver, and a reference the algorithm's
    config does not use (GRPO without a KL loss) is dropped."""
    flow = dataflow_preset(config.algorithm_name)
    kept = [c for c in flow.calls if c.model in roles]
    names = {c.name for c in kept}
    calls = tuple(replace(c, deps=tuple(d for d in c.deps if d in names)) for c in kept)
    return replace(flow, calls=calls, value_models=tuple(m for m in flow.value_models if m in roles))


def run_cluster(config: RunConfig) -> tuple[Any, str]:
    """This machine as one node of placement.num_devices (or 4) logical devices: the calibrated
    local cluster when placement.calibration exists, else the uncalibrated preset; and which."""
    n = config.placement.num_devices or 4
    path = Path(config.placement.calibration)
    if config.placement.calibration and path.exists():
        from workbench.planner.calibrate import load_calibration

        return load_calibration(path).cluster(1, n), f"calibrated local cluster ({path}), {n} device(s)"
    return (
        dataclasses.replace(cluster_preset("local"), devices_per_node=n),
        f"local preset, UNCALIBRATED (no {path}), {n} device(s)",
    )


def run_plan(config: RunConfig, policy: Path, prompt_width: float | None = None) -> RunPlan | CallRunPlan | None:
    """The plan of placement.plan (None when the run places by hand), read, priced (for prompts
    of `prompt_width` tokens, see `run_workload`) and checked against the run on the driver:
    every refusal is a ConfigError naming the plan's field."""
    given = config.placement.plan
    if given is None:
        return None
    config.check_plan()  # its form, and not beside the hand-written pools (again: a config edited in Python)
    roles = list(planner_models(config, policy))
    flow = run_dataflow(config, roles)
    specs = specs_from_models(planner_models(config, policy))
    workload, (cluster, where_priced) = run_workload(config, prompt_width), run_cluster(config)
    if given == AUTOMAP:
        three_d = config.actor.backend == "3d" and ("critic" not in roles or config.critic.backend == "3d")
        placements = [p for p in set_partitions(flow.models) if _reference_with_actor(p)]
        try:
            problem = Problem(flow, specs, workload, cluster, max_tp=None if three_d else 1, max_pp=1)
            found = automap(problem, placements=placements)
        except Exception as error:
            raise ConfigError("placement.plan", given, f"the auto-mapper found no plan: {error}") from None
        values, source, file = plan_to_dict(found), AUTOMAP, None
        _reference_layout_as_actor(values)  # the reference runs in the actor's processes
    elif given == SEARCH:
        values, source, file = searched_plan(config, flow, specs, workload, cluster), SEARCH, None
    elif isinstance(given, str):
        file = Path(given).expanduser()
        if not file.is_file():
            raise ConfigError(
                "placement.plan", given, 'no such plan file: give "automap", a YAML plan file or a plan mapping'
            )
        values, source = yaml.safe_load(file.read_text(encoding="utf-8")), str(file)
    else:
        values, source, file = given, "inline", None
    if isinstance(values, dict) and "layouts" in values:
        raise ConfigError("placement.plan", source, _PER_CALL_FIX)
    if isinstance(values, dict) and "calls" in values:
        return _call_plan(config, values, flow, specs, workload, cluster, source, where_priced, file)
    try:
        plan = plan_from_dict(values, flow, specs, workload, cluster, where="placement.plan")
    except PlanFormatError as error:
        fix = error.fix + (" (placement.num_devices)" if "more devices" in error.fix else "")
        raise ConfigError(error.where, error.value, fix + (f" [in {file}]" if file else "")) from None
    _check_runnable(config, plan, values)
    return RunPlan(plan, source, where_priced)


def _call_plan(config, values, flow, specs, workload, cluster, source, where_priced, file) -> CallRunPlan:
    """A `calls:` plan read, checked against what the run's workers run, and priced."""
    try:
        plan, name = execution_plan_from_dict(values, flow, cluster, where="placement.plan")
    except PlanFormatError as error:
        raise ConfigError(error.where, error.value, error.fix + (f" [in {file}]" if file else "")) from None
    if config.actor.lora is not None:
        raise ConfigError(
            "placement.plan.calls",
            "actor.lora",
            "a per-call plan runs the reference as a group of its own: no LoRA yet",
        )
    backends = {"actor": config.actor.backend, "reference": config.actor.backend}
    for call, (_, layout) in plan.layouts.items():
        backend = backends.get(flow.call(call).model, config.critic.backend)
        if (layout.tp > 1 or layout.pp > 1) and backend != "3d":
            raise ConfigError(
                f"placement.plan.calls.{call}",
                layout.short(),
                f"tensor and pipeline parallelism run on the 3d backend only (this model's is {backend!r}): tp 1, pp 1",
            )
    estimate = PlanEvaluator(Problem(flow, specs, workload, cluster)).evaluate(plan)
    return CallRunPlan(plan, flow, estimate, source, where_priced, name)


_PER_CALL_FIX = (
    "a per-call execution plan (ReaLHF's) is written as calls: {<call>: {devices, first_device, pp, tp, dp}} "
    "(workbench.planner.call_plan_io; the search's plans: execution_plan_to_dict), or found by the search "
    "(search); or give a model-level plan (sets: ...) or automap"
)
SEARCH_STEPS = 2_000
"""Proposals per chain of the search a run makes (4 chains, the search's default): well under a
second for PPO on a few devices here."""


def searched_plan(config: RunConfig, flow, specs, workload, cluster) -> dict[str, Any]:
    """placement.plan=search: ReaLHF's search over the plans this runtime deploys, written in the
    `calls:` form."""
    three_d = config.actor.backend == "3d" and ("critic" not in flow.models or config.critic.backend == "3d")
    try:
        problem = Problem(flow, specs, workload, cluster, max_tp=None if three_d else 1, max_pp=1)
        found = search(problem, max_steps=SEARCH_STEPS, runnable=True)
    except Exception as error:
        raise ConfigError("placement.plan", SEARCH, f"the search found no plan: {error}") from None
    return execution_plan_to_dict(found.plan, "search")


def _reference_with_actor(placement: tuple[tuple[str, ...], ...]) -> bool:
    return any("actor" in s and "reference" in s for s in placement) or not any("reference" in s for s in placement)


def _reference_layout_as_actor(values: dict) -> None:
    for s in values["sets"]:
        if "reference" in s["models"] and "actor" in s["models"]:
            actor = s["models"]["actor"]
            s["models"]["reference"] = {k: actor[k] for k in ("pp", "tp", "dp")}


def _check_runnable(config: RunConfig, plan: Plan, values: dict) -> None:
    """What the run's workers run of a priced plan: the reference in the actor's processes
    (its set and layout), tensor and pipeline parallelism only with backend "3d", no pipelined
    generation layout."""
    index = {m: i for i, s in enumerate(values["sets"]) for m in s["models"]}
    at = lambda m: f"placement.plan.sets[{index[m]}].models.{m}"  # noqa: E731
    backends = {"actor": config.actor.backend, "reference": config.actor.backend}
    backends |= {"critic": config.critic.backend, "cost_critic": config.critic.backend}
    for s in plan.sets:
        for m, a in s.assignments.items():
            for mesh, where, generating in ((a.strategy, at(m), False), (a.generation, f"{at(m)}.generation", True)):
                if mesh is None:
                    continue
                section = "actor" if m in ("actor", "reference") else "critic"
                if mesh.pp > 1 and (backends.get(m) != "3d" or generating):
                    raise ConfigError(
                        f"{where}.pp",
                        mesh.pp,
                        f'pipeline parallelism runs the "3d" backend\'s training and scoring forwards '
                        f"(actor, reference, critic), not generation: set {section}.backend=3d, or pp: 1",
                    )
                if mesh.tp > 1 and backends[m] != "3d":
                    raise ConfigError(
                        f"{where}.tp",
                        mesh.tp,
                        f'tensor parallelism runs on the "3d" backend only ({section}.backend is '
                        f"{backends[m]!r}): set {section}.backend=3d or tp: 1",
                    )
    if "reference" in index:
        actor, ref = plan.set_of("actor"), plan.set_of("reference")
        a, r = actor.assignments["actor"].strategy, ref.assignments["reference"].strategy
        if actor is not ref or (a.pp, a.tp, a.dp) != (r.pp, r.tp, r.dp):
            raise ConfigError(
                at("reference"),
                r.short(),
                f"the run keeps the reference in the actor's processes: put it in the actor's set "
                f"(sets[{index['actor']}]) with the actor's layout {a.short()}",
            )
