"""RolloutLink: the trained actor's weights, pushed to a rollout group on other devices (a
WeightLink, which does the same for any trained group and a copy of its model elsewhere).

A rollout group is an `ActorRolloutRefWorker` group with `train=False` and a rollout engine, on
devices of its own or on some (or all) of the actor's: there its ranks take turns with the
actor's device by device, and the link's calls, which meet in one collective, run as joint
calls (`workbench.controller.joint_calls`). The link joins the actor's rank 0 and every rollout
rank in one weight channel (workbench.hybrid.channel); `push(version)` then sends the current
weights — all of them, or the LoRA adapters alone — one tensor at a time, loaded in place on
each rollout rank. With `reallocate` every actor rank joins as a source and the push is a
reallocation, a layer unit at a time (workbench.workers.weight_member). It returns at once: the
actor's ranks send after the calls queued before (an update), the rollout's ranks take the
weights after theirs (a generation in flight), and the generations asked for afterwards use
them. Both sides record spans (`async.send_weights`,
`async.receive_weights`) with their bytes.
"""

from __future__ import annotations

from typing import Any

from workbench.controller import joint_calls
from workbench.controller.future import DataFuture
from workbench.errors import ConfigError
from workbench.workers.critic import CriticConfig


def check_rollout_pair(actor: Any, rollout: Any) -> None:
    """Refuse, on the driver, a rollout group that cannot take the actor's weights."""
    a, r = _actor_config(actor, "actor"), _actor_config(rollout, "rollout")
    if not a.train:
        raise ConfigError("Groups.actor: ActorConfig.train", a.train, "the actor must train (train=True)")
    if r.train or r.rollout is None:
        raise ConfigError(
            "Groups.rollout: ActorConfig(train, rollout)",
            (r.train, r.rollout),
            "a rollout group generates only: ActorConfig(train=False, rollout='hf' or 'vllm')",
        )
    if a.model_path != r.model_path:
        raise ConfigError(
            "Groups.rollout: ActorConfig.model_path",
            r.model_path,
            f"the rollout must load the actor's model ({a.model_path}) to take its weights",
        )
    if a.lora != r.lora:
        raise ConfigError(
            "Groups.rollout: ActorConfig.lora",
            r.lora,
            f"use the actor's LoRA settings ({a.lora}): the rollout receives the adapters by name",
        )
    if rollout.mesh.tp > 1 or rollout.mesh.pp > 1:
        raise ConfigError(
            "Groups.rollout: its mesh",
            rollout.mesh,
            "a rollout group takes whole weights: give it data-parallel ranks only (tp=1, pp=1)",
        )
    if r.temperature != a.temperature:
        raise ConfigError(
            "Groups.rollout: ActorConfig.temperature",
            r.temperature,
            f"use the actor's ({a.temperature}): the rollout's log-probs are the behaviour policy's",
        )


def _actor_config(group: Any, role: str) -> Any:
    """The ActorConfig of an ActorRolloutRefWorker group; refused for any other group."""
    config = getattr(group, "config", None)
    if config is None or not hasattr(config, "train"):
        raise ConfigError(f"Groups.{role}", type(config).__name__, "give an ActorRolloutRefWorker group")
    return config


def reallocatable(trained: Any, copy: Any) -> bool:
    """Whether reallocation can move `trained`'s weights (configs) into `copy` (both pp = 1,
    which WeightLink checks): between a critic and its replica, each FSDP (whole weights, a
    layer unit gathered at a time) or tensor parallel (backend "3d": its own pieces), or from an
    FSDP actor into a rollout group: HF engines load a unit as it arrives, vLLM engines reload
    the model once every unit has (as they load a broadcast). Not LoRA's adapters, which only a
    broadcast sends."""
    if isinstance(trained, CriticConfig):
        backends = {trained.backend, getattr(copy, "backend", None)}
        return isinstance(copy, CriticConfig) and backends <= {"fsdp", "3d"} and trained.lora is None
    actor = getattr(trained, "train", False) and getattr(trained, "backend", None) == "fsdp"
    return bool(actor and trained.lora is None and getattr(copy, "rollout", None) in ("hf", "vllm"))


class WeightLink:
    """A weight channel from a trained group to every rank of a copy of its model in another
    group (a rollout group, a critic's replica), on other devices or some of the same: both
    workers offer the weight-channel methods (workbench.workers.weight_member).

    `reallocate`: move the weights by ReaLHF's layer-by-layer reallocation, every trained rank a
    source (workbench.hybrid.reallocate), instead of a broadcast from the trained group's rank 0.
    It needs layouts it can move between (`reallocatable`: FSDP or tensor-parallel critics, an
    FSDP actor into HF or vLLM engines; pp = 1); None picks it for a critic and its replica."""

    def __init__(self, trained: Any, copy: Any, reallocate: bool | None = None):
        trained_config, copy_config = (getattr(g, "config", None) for g in (trained, copy))
        # a pipeline stage's pieces: not yet
        can = reallocatable(trained_config, copy_config) and trained.mesh.pp == 1 and copy.mesh.pp == 1
        if reallocate and not can:
            raise ConfigError(
                "WeightLink(reallocate=True)",
                (trained.role, copy.role),
                "reallocation moves weights between a critic and its replica (backend 'fsdp' or '3d', "
                "pp=1, no LoRA) or from an actor without LoRA (backend='fsdp') to a rollout group "
                "(rollout='hf' or 'vllm'); use reallocate=None or False for a broadcast",
            )
        critics = all(isinstance(c, CriticConfig) for c in (trained_config, copy_config))
        self.reallocates = (critics and can) if reallocate is None else reallocate
        self.trained, self.copy = trained, copy
        self.hostsets = (trained.hostset, copy.hostset)
        nodes = set(trained.pool.node_ids) | set(copy.pool.node_ids)
        shared = trained.pool.shares_devices(copy.pool)
        sources = trained.world_size if self.reallocates else 0  # 0: the trained rank 0 broadcasts
        first_copy_rank = max(1, sources)
        address = trained.open_weight_channel(first_copy_rank + copy.world_size, len(nodes) <= 1, shared).get()
        with joint_calls():  # the channel's rendezvous needs both groups at once
            joined = [
                trained.join_weight_channel(address, 0, sources),
                copy.join_weight_channel(address, first_copy_rank, sources),
            ]
        for future in joined:
            future.get()
        self.pushes: list[list[DataFuture]] = []
        self.token = object()
        for group in (trained, copy):
            group.hostset.weight_links[group.role] = self.token

    def current(self) -> bool:
        """Whether both groups are the processes this link joined (not re-created since)."""
        return (self.trained.hostset, self.copy.hostset) == self.hostsets

    def push(self, version: int) -> list[DataFuture]:
        """Send the trained group's current weights as `version`; returns [send, receive] at once.
        A push's failure surfaces at the next push (or `check()`), before more is sent."""
        if any(g.hostset.weight_links.get(g.role) is not self.token for g in (self.trained, self.copy)):
            raise ConfigError(
                "WeightLink.push",
                f"{self.trained.role} -> {self.copy.role}",
                "a newer link joined one of these roles to another weight channel (a role's processes hold "
                "one at a time, and this link's would hang): push over the newest link, or create this one again",
            )
        self.check()
        with joint_calls():  # one collective: on shared devices neither may wait for the other
            futures = [self.trained.send_weights(version), self.copy.receive_weights(version)]
        self.pushes.append(futures)
        return futures

    def check(self) -> list[dict]:
        """Wait for the pushes sent so far; their stats (raises the first one's error)."""
        done, self.pushes = self.pushes, []
        return [future.get() for futures in done for future in futures]


class RolloutLink(WeightLink):
    """A weight channel from `actor` (trained) to `rollout` (generation only): a broadcast, or
    with `reallocate` every actor rank sends its share, a layer unit at a time, and each rollout
    rank loads a unit into its HF engine as it arrives, or the whole model into its vLLM engine
    once every unit has (AlgoConfig.rollout_weights)."""

    def __init__(self, actor: Any, rollout: Any, reallocate: bool = False):
        check_rollout_pair(actor, rollout)
        super().__init__(actor, rollout, reallocate=reallocate)

    @property
    def actor(self) -> Any:
        return self.trained

    @property
    def rollout(self) -> Any:
        return self.copy
