"""The dataflow of one RLHF iteration: model function calls and their dependencies.

A call (ReaLHF's "model function call") is one method of one model: generate, inference
(forward only) or train (forward, backward, optimizer step); derived dataflows name each call
after its step (`workbench.steps`). The topological levels of this graph are what the HybridFlow
paper calls its three stages (generation, preparation, training).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from workbench.planner.specs import ModelSpec, model_preset

CallKind = Literal["generate", "inference", "train"]


@dataclass(frozen=True)
class Call:
    """One model function call."""

    name: str
    """Unique name in the dataflow: the step's name (workbench.steps), e.g. 'gen'."""
    model: str
    """Role that runs it ('actor', 'critic', ...); calls of one role share parameters."""
    kind: CallKind
    """generate (memory-bound decoding), inference (forward) or train (fwd+bwd+step)."""
    deps: tuple[str, ...] = ()
    """Calls of the same iteration whose outputs this call reads."""
    batch_factor: float = 1.0
    """Work relative to one pass over the iteration's sequences (e.g. 2.0 when the actor
    update also runs a same-sized pre-training batch, as Safe-RLHF's PPO-ptx does)."""


@dataclass(frozen=True)
class Dataflow:
    """The calls of one iteration, listed in a valid execution (topological) order."""

    name: str
    """Algorithm name."""
    calls: tuple[Call, ...]
    """All calls; every dependency must appear before its dependant."""
    value_models: tuple[str, ...] = ()
    """Roles with a scalar head (critic, reward, cost)."""

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for c in self.calls:
            if c.name in seen:
                raise ValueError(f"dataflow {self.name!r}: call name {c.name!r} repeated")
            missing = [d for d in c.deps if d not in seen]
            if missing:
                raise ValueError(
                    f"dataflow {self.name!r}: call {c.name!r} depends on {missing}, which must be listed before it"
                )
            seen.add(c.name)

    @property
    def models(self) -> tuple[str, ...]:
        """Roles in order of first appearance."""
        return tuple(dict.fromkeys(c.model for c in self.calls))

    def call(self, name: str) -> Call:
        for c in self.calls:
            if c.name == name:
                return c
        raise KeyError(f"dataflow {self.name!r} has no call {name!r}; calls: {[c.name for c in self.calls]}")

    def calls_of(self, model: str) -> tuple[Call, ...]:
        return tuple(c for c in self.calls if c.model == model)

    def trained(self, model: str) -> bool:
        return any(c.kind == "train" for c in self.calls_of(model))

    def generates(self, model: str) -> bool:
        return any(c.kind == "generate" for c in self.calls_of(model))

    def with_rollout(self, role: str = "rollout") -> Dataflow:
        """The same iteration with generation on a rollout group of its own (asynchronous RL's
        split, `algorithms.asynchronous`): every generate call moves to `role`, a frozen copy of
        the model that generated it, which takes that model's weights after each update."""
        if role in self.models:
            raise ValueError(f"dataflow {self.name!r} already has a role {role!r}")
        if not any(c.kind == "generate" for c in self.calls):
            raise ValueError(f"dataflow {self.name!r} has no generate call to move to a rollout group")
        calls = tuple(dataclasses.replace(c, model=role) if c.kind == "generate" else c for c in self.calls)
        return dataclasses.replace(self, name=f"{self.name}+{role}", calls=calls)

    def driver_inputs(self) -> tuple[str, ...]:
        """Calls whose outputs the driver gathers before the training calls (it computes the
        advantages): the training calls' dependencies that do not train, in call order."""
        trains = [c for c in self.calls if c.kind == "train"]
        return tuple(dict.fromkeys(d for c in trains for d in c.deps if self.call(d).kind != "train"))

    def levels(self) -> dict[str, int]:
        """The topological level of every call (longest dependency chain from a source). For
        PPO: 0 generation, 1 preparation, 2 training (HybridFlow §2 calls them stages)."""
        level: dict[str, int] = {}
        for c in self.calls:
            level[c.name] = 1 + max((level[d] for d in c.deps), default=-1)
        return level

    @property
    def n_levels(self) -> int:
        return 1 + max(self.levels().values())

    def model_specs(self, base: ModelSpec | str | dict[str, ModelSpec | str]) -> dict[str, ModelSpec]:
        """A spec per role: one shape for all (value roles get a scalar head), or a dict."""
        if isinstance(base, dict):
            out: dict[str, ModelSpec] = {}
            for role in self.models:
                if role not in base:
                    raise KeyError(f"no model spec for role {role!r}; roles: {self.models}")
                given = base[role]
                spec = model_preset(given) if isinstance(given, str) else given
                out[role] = spec.as_value_model() if role in self.value_models else spec
            return out
        spec = model_preset(base) if isinstance(base, str) else base
        return {r: spec.as_value_model() if r in self.value_models else spec for r in self.models}
