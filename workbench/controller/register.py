"""@register: mark a worker method as callable from the driver, with its transfer protocol.

    class Critic(Worker):
        @register(DP_PROTO)
        def compute_values(self, batch: Batch) -> Batch: ...

The decorator only attaches a `Registration` to the function; WorkerGroup reads it to build
the driver-side method. The worker-side method stays an ordinary method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from workbench import checks
from workbench.controller.protocols import BUILTIN, DP_PROTO, Protocol

Execute = Literal["all", "rank_zero"]
ATTRIBUTE = "__workbench_registration__"


@dataclass(frozen=True)
class Registration:
    protocol: Protocol
    execute: Execute = "all"
    """"all": every rank runs the method (SPMD); "rank_zero": only rank 0 runs it."""
    pad: bool = True
    """Pad a Batch whose rows do not divide by the data-parallel size (the padding is removed
    on collect); False refuses such a batch with an error instead."""
    remembers_path: bool = False
    """The method saves the role's state at its `path` argument (the first): the group keeps
    the last path issued, and `session.recover` reloads the role from it."""

    @property
    def returns_rows(self) -> bool:
        """Outputs are joined row-wise, so another group may later take them apart by rows:
        each rank then also returns a small OutputMeta (its row counts)."""
        return self.execute == "all" and getattr(self.protocol.collect, "joins_rows", False)


def register(
    protocol: Protocol | str = DP_PROTO, execute: Execute = "all", pad: bool = True, remembers_path: bool = False
) -> Callable:
    if isinstance(protocol, str):
        if protocol not in BUILTIN:
            raise ValueError(f"unknown protocol {protocol!r}; known: {sorted(BUILTIN)}")
        protocol = BUILTIN[protocol]
    checks.one_of("register", "execute", execute, ("all", "rank_zero"))

    def mark(method: Callable) -> Callable:
        setattr(method, ATTRIBUTE, Registration(protocol, execute, pad, remembers_path))
        return method

    return mark


def registered_methods(cls: type) -> dict[str, Registration]:
    """Every registered method of a worker class, its bases included."""
    found = {}
    for klass in reversed(cls.__mro__):
        for name, attr in vars(klass).items():
            registration = getattr(attr, ATTRIBUTE, None)
            # An override without @register keeps its base's registration.
            if registration is not None:
                found[name] = registration
    return found
