"""Typed handles: what the driver can call on each role, for editors, type checkers and readers.

A WorkerGroup finds its methods when they are called (that is what lets an old handle follow
its role to a re-created group), so nothing in its class says what `groups.actor` offers.
These Protocols say it: one per worker class, listing the methods it registers with their
driver-side signatures. An input that a worker receives as a Batch may be given as a Batch or
as another call's DataFuture (each rank then fetches its rows from the source ranks), and
every call returns a DataFuture at once; `.get()` gives what the method's protocol collects.

`session.group(role, ActorRolloutRefWorker, ...)` is typed as an ActorHandle (likewise the
other worker classes here), and `algorithms.Groups` annotates each role with its handle.
tests/workers/test_handles.py checks that each Protocol lists exactly the registered methods
of its class with the same parameters, so the two cannot drift apart, and holds the types a
type checker must see (`typing.assert_type`, checked by mypy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from workbench.controller.future import DataFuture
from workbench.data.batch import Batch

if TYPE_CHECKING:
    from workbench.agents.env import Environment
    from workbench.controller.register import Registration
    from workbench.controller.worker_group import HostSet
    from workbench.engines.contract import LossFn
    from workbench.engines.multi_turn import EpisodeConfig
    from workbench.engines.rollout import SamplingConfig
    from workbench.hybrid.channel import ChannelAddress
    from workbench.mesh import Mesh

Rows = Batch | DataFuture
"""Rows for a method that takes a Batch: a Batch on the driver, or another call's result."""


class GroupHandle(Protocol):
    """What every worker group offers besides its registered methods (see WorkerGroup)."""

    @property
    def role(self) -> str: ...
    @property
    def config(self) -> Any: ...
    @property
    def hostset(self) -> HostSet: ...
    @property
    def mesh(self) -> Mesh: ...
    @property
    def world_size(self) -> int: ...
    @property
    def methods(self) -> dict[str, Registration]: ...
    def call(self, method: str, *args: Any, **kwargs: Any) -> DataFuture: ...


class WeightChannelHandle(Protocol):
    """The weight-channel methods of workers that mix in WeightChannelMember
    (workbench.workers.weight_member): the actor and the critic."""

    def open_weight_channel(
        self, size: int, local: bool, shared_device: bool = False
    ) -> DataFuture[ChannelAddress]: ...
    def join_weight_channel(
        self, address: ChannelAddress, first_rank: int, sources: int = 0
    ) -> DataFuture[list[bool]]: ...
    def send_weights(self, version: int) -> DataFuture[list[dict]]: ...
    def receive_weights(self, version: int) -> DataFuture[list[dict]]: ...


class SnapshotsHandle(Protocol):
    """The in-memory snapshot methods of workers that mix in Snapshots (workbench.workers.snapshots):
    the actor and the critic. `Algorithm.snapshot()` / `restore()` call them on every trained role."""

    def snapshot(self, name: str) -> DataFuture[list[int]]: ...
    def restore_snapshot(self, name: str) -> DataFuture[list[str]]: ...
    def drop_snapshot(self, name: str) -> DataFuture[list[bool]]: ...
    def state_digest(self) -> DataFuture[list[str]]: ...


class ActorHandle(GroupHandle, WeightChannelHandle, SnapshotsHandle, Protocol):
    """ActorRolloutRefWorker (workbench.workers.actor): generation, log-probs, training; also
    the `reference` role when the actor's processes hold the reference copy."""

    def generate_sequences(self, prompts: Rows, sampling: SamplingConfig = ...) -> DataFuture[Batch]: ...
    def generate_episodes(
        self, prompts: Rows, env: Environment, sampling: SamplingConfig = ..., episodes: EpisodeConfig = ...
    ) -> DataFuture[Batch]: ...
    def compute_log_prob(self, batch: Rows) -> DataFuture[Batch]: ...
    def compute_loss(self, batch: Rows) -> DataFuture[Batch]: ...
    def compute_ref_log_prob(self, batch: Rows) -> DataFuture[Batch]: ...
    def reference_bytes(self) -> DataFuture[list[dict[str, int]]]: ...
    def update_actor(self, batch: Rows, loss_fn: LossFn) -> DataFuture[dict[str, float]]: ...
    def replay_update(self, batch: Rows, losses: dict[str, LossFn], kl: bool = ...) -> DataFuture[dict]: ...
    def save_checkpoint(self, path: str) -> DataFuture[list[str]]: ...
    def load_checkpoint(self, path: str) -> DataFuture[list[str]]: ...
    def export_hf(self, path: str, merged: bool = ...) -> DataFuture[list[str]]: ...


class CriticHandle(GroupHandle, WeightChannelHandle, SnapshotsHandle, Protocol):
    """CriticWorker (workbench.workers.critic): values and value-function training; also the
    `cost_critic` role (Safe-RLHF, output_key="cost_values")."""

    def compute_values(self, batch: Rows, output_key: str = ...) -> DataFuture[Batch]: ...
    def update_critic(self, batch: Rows, loss_fn: LossFn) -> DataFuture[dict[str, float]]: ...
    def save_checkpoint(self, path: str) -> DataFuture[list[str]]: ...
    def load_checkpoint(self, path: str) -> DataFuture[list[str]]: ...
    def export_hf(self, path: str, merged: bool = ...) -> DataFuture[list[str]]: ...


class RewardModelHandle(GroupHandle, Protocol):
    """RewardModelWorker (workbench.workers.reward): `scores` from a reward model."""

    def compute_reward(self, batch: Rows) -> DataFuture[Batch]: ...


class CostModelHandle(RewardModelHandle, Protocol):
    """CostModelWorker (workbench.workers.reward): Safe-RLHF's cost model, writing `costs`."""

    def compute_cost(self, batch: Rows) -> DataFuture[Batch]: ...


class RuleRewardHandle(Protocol):
    """RuleReward (workbench.workers.rule_reward): a Python function scored off the driver,
    called like a reward (or, with output_key="costs", a cost) model's group."""

    def compute_reward(self, batch: Rows) -> DataFuture[Batch]: ...
    def compute_cost(self, batch: Rows) -> DataFuture[Batch]: ...
    def process_ids(self) -> list[tuple[int, int]]: ...


__all__ = [
    "ActorHandle",
    "CostModelHandle",
    "CriticHandle",
    "GroupHandle",
    "RewardModelHandle",
    "Rows",
    "RuleRewardHandle",
]
