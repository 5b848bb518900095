"""From a RunConfig to live pieces: the starting model, the prompt data, the worker groups on
their pools, and the algorithm that drives them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from algorithms import ALGORITHMS, Algorithm, Groups
from workbench.data import arithmetic
from workbench.data.prompts import PromptLoader, load_prompts, tokenize_prompts
from workbench.data.tasks import Task, get_task
from workbench.errors import ConfigError
from workbench.run.config import FROM_MODEL, RunConfig
from workbench.session import Session
from workbench.workers.actor import ActorRolloutRefWorker
from workbench.workers.critic import CriticWorker
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
    """Training and held-out rows (prompt, ground_truth): from files, or generated arithmetic
    problems, put to the model the task's way (text or chat), where no training problem shares
    a prompt with a held-out one (data.held_out="harder" draws those one digit longer)."""
    data, put = config.data, task_of(config).prompt
    held_out = load_prompts(data.eval_file) if data.eval_file else None
    if held_out is None:
        difficulty = arithmetic.harder(data.arithmetic) if data.held_out == "harder" else data.arithmetic
        problems = arithmetic.generate(difficulty, data.eval_size, seed=data.seed + 1)
        held_out = [{"prompt": put(p), "ground_truth": p.ground_truth} for p in problems]
    if data.train_file:
        return load_prompts(data.train_file), held_out
    seen = {_key(row["prompt"]) for row in held_out}
    train = [
        {"prompt": put(p), "ground_truth": p.ground_truth}
        for p in arithmetic.generate(data.arithmetic, data.train_size, seed=data.seed)
        if _key(put(p)) not in seen
    ]
    if not train:
        raise ConfigError(
            "data.train_size",
            data.train_size,
            "every generated problem is also held out; "
            "draw more (data.train_size) or harder ones (data.arithmetic.digits)",
        )
    return train, held_out


def _key(prompt) -> str:
    """A hashable stand-in for a prompt (chat prompts are lists of dicts)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def task_of(config: RunConfig) -> Task:
    try:
        return get_task(config.data.task)
    except KeyError as error:
        raise ConfigError("data.task", config.data.task, str(error.args[0])) from None


def prompt_data(config: RunConfig, tokenizer) -> tuple[PromptLoader, Any]:
    """The training loader and the held-out prompts as one Batch."""
    train, held_out = prompt_rows(config)
    loader_cfg = config.data.loader
    loader = PromptLoader(train, tokenizer, loader_cfg)
    eval_batch = tokenize_prompts(held_out, tokenizer, loader_cfg.max_prompt_length, loader_cfg.overlong)
    return loader, eval_batch


class TaskCost:
    """fn(text, truth) -> cost for RuleReward: the task's cost with the run's CostConfig bound
    (a plain picklable object: it travels to the scoring processes)."""

    def __init__(self, task: str, cost_config):
        self.task, self.cost_config = task, cost_config
        self.__qualname__ = f"{task}.cost"

    def __call__(self, response: str, truth: str) -> float:
        cost = get_task(self.task).cost
        return cost(response, self.cost_config) if self.task == "arithmetic" else cost(response)


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


def devices_needed(config: RunConfig) -> int:
    critic = "critic" in required_roles(config) and config.placement.critic_devices
    place = config.placement
    return place.actor_devices + (place.critic_devices if critic else 0) + place.rollout_devices


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
    module, adapters off). Plain values: the planner and the run are sibling layers."""
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


def algorithm(config: RunConfig, session: Session, policy: Path) -> Algorithm:
    """Pools and groups per the placement, the rule reward (and cost), and the algorithm."""
    roles, place = required_roles(config), config.placement
    task = task_of(config)
    timeout = config.data.reward_timeout
    groups = Groups(reward=RuleReward(task.score, timeout=timeout))
    if "cost" in roles:
        if task.cost is None:
            raise ConfigError(
                "data.task", config.data.task, f"{config.algorithm_name} needs a cost; this task has none"
            )
        groups.cost = RuleReward(TaskCost(task.name, config.data.cost), timeout=timeout, output_key="costs")

    algo_config = algorithm_config(config)
    actor_config = replace(
        config.actor,
        model_path=str(policy) if config.actor.model_path == FROM_MODEL else config.actor.model_path,
        reference="reference" in roles,
        temperature=config.actor.temperature if config.sampling.greedy else config.sampling.temperature,
    )
    actor_pool = session.pool("actor_pool", place.actor_devices)
    if place.rollout_devices:  # generation on devices of its own: the actor only trains
        rollout_config = replace(actor_config, train=False, reference=False, rollout=actor_config.rollout or "hf")
        groups.rollout = session.group(
            "rollout", ActorRolloutRefWorker, session.pool("rollout_pool", place.rollout_devices), rollout_config
        )
        actor_config = replace(actor_config, rollout=None)
    groups.actor = session.group("actor", ActorRolloutRefWorker, actor_pool, actor_config)
    if "reference" in roles:
        groups.reference = groups.actor  # the reference copy lives in the actor's processes
    if "critic" in roles:
        critic_config = replace(config.critic, model_path=critic_path(config, policy))
        pool = session.pool("critic_pool", place.critic_devices) if place.critic_devices else actor_pool
        critics = {"critic": (CriticWorker, critic_config)}
        if "cost_critic" in roles:
            critics["cost_critic"] = (CriticWorker, critic_config)
        for role, group in session.fused(pool, **critics).items():
            setattr(groups, role, group)
    return ALGORITHMS[config.algorithm_name](groups, algo_config)
