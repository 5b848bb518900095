"""The typed handles (workbench.workers.handles) say exactly what each worker class registers,
with the same parameters, so editors and type checkers see the methods a role really has."""

import inspect
import typing

import pytest

from algorithms.groups import Groups
from workbench import Batch, DataFuture, Session, Worker, register
from workbench.controller.register import registered_methods
from workbench.controller.worker_group import WorkerGroup
from workbench.engines.rollout import SamplingConfig
from workbench.workers import handles
from workbench.workers.actor import ActorRolloutRefWorker
from workbench.workers.critic import CriticWorker
from workbench.workers.reward import CostModelWorker, RewardModelWorker
from workbench.workers.rule_reward import RuleReward

WORKER_HANDLES = [
    (handles.ActorHandle, ActorRolloutRefWorker),
    (handles.CriticHandle, CriticWorker),
    (handles.RewardModelHandle, RewardModelWorker),
    (handles.CostModelHandle, CostModelWorker),
]


def listed(handle: type, common: type | None = handles.GroupHandle) -> dict:
    """The methods a handle Protocol lists (its bases' included), apart from `common`'s."""
    skip = {object, typing.Protocol, typing.Generic, common}
    methods: dict = {}
    for klass in reversed(handle.__mro__):
        if klass not in skip:
            methods.update({n: f for n, f in vars(klass).items() if inspect.isfunction(f) and not n.startswith("_")})
    return methods


def parameters(fn) -> list[tuple[str, inspect._ParameterKind, bool]]:
    """(name, kind, has a default) of each parameter after self."""
    return [(p.name, p.kind, p.default is not p.empty) for p in list(inspect.signature(fn).parameters.values())[1:]]


@pytest.mark.parametrize("handle, cls", WORKER_HANDLES, ids=lambda x: x.__name__)
def test_each_handle_lists_exactly_the_registered_methods_of_its_worker(handle, cls):
    methods = listed(handle)
    assert sorted(methods) == sorted(registered_methods(cls))
    for name, fn in methods.items():
        assert parameters(fn) == parameters(getattr(cls, name)), f"{handle.__name__}.{name} vs {cls.__name__}.{name}"


def test_the_rule_reward_handle_lists_its_public_methods():
    public = {n: f for n, f in vars(RuleReward).items() if inspect.isfunction(f) and not n.startswith("_")}
    methods = listed(handles.RuleRewardHandle, common=None)
    assert sorted(methods) == sorted(public)
    for name, fn in methods.items():
        assert parameters(fn) == parameters(public[name]), f"RuleRewardHandle.{name}"


def test_what_every_group_handle_offers_is_on_worker_group():
    common = [n for n in vars(handles.GroupHandle) if not n.startswith("_")]
    assert common and set(common) <= set(dir(WorkerGroup)) | set(WorkerGroup.__annotations__)
    assert parameters(handles.GroupHandle.call) == parameters(WorkerGroup.call)


def test_save_checkpoint_is_registered_to_be_remembered_for_recover():
    for cls in (ActorRolloutRefWorker, CriticWorker):
        remembered = {name for name, r in registered_methods(cls).items() if r.remembers_path}
        assert remembered == {"save_checkpoint"}, cls.__name__


def handles_as_a_type_checker_sees_them(session: Session, prompts: Batch) -> None:
    """Never run: the type checker (mypy) checks these types, as an editor shows them."""

    class Mine(Worker):
        @register()
        def noop(self) -> None: ...

    actor = session.group("actor", ActorRolloutRefWorker, "actor_pool")
    typing.assert_type(actor, handles.ActorHandle)
    generated = actor.generate_sequences(prompts, SamplingConfig())
    typing.assert_type(generated, DataFuture[Batch])
    typing.assert_type(
        actor.update_actor(generated, lambda outputs, batch: (outputs["log_probs"].sum(), {})).get(), dict[str, float]
    )
    typing.assert_type(session.group("critic", CriticWorker, "critic_pool"), handles.CriticHandle)
    typing.assert_type(session.group("reward", RewardModelWorker, "reward_pool"), handles.RewardModelHandle)
    typing.assert_type(session.group("cost", CostModelWorker, "reward_pool"), handles.CostModelHandle)
    typing.assert_type(session.group("mine", Mine, "mine_pool"), WorkerGroup)
    groups = Groups(
        actor=actor,
        reference=session.fused("actor_pool", actor=ActorRolloutRefWorker)["actor"],
        reward=RuleReward(lambda text, truth: float(text == truth)),
    )
    typing.assert_type(groups.actor.compute_log_prob(generated), DataFuture[Batch])
    typing.assert_type(groups.reward.compute_reward(generated), DataFuture[Batch])
