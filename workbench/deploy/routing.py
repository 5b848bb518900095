"""CallRouter: one role's handle under a per-call plan, sending each call to the group that the
plan put it on, so an algorithm's `step` runs unchanged.

    critic = CallRouter("critic", home, {"compute_values": replica}, train_method="update_critic")
    critic.compute_values(gen)   # on the replica, after the home's newest weights are pushed to it
    critic.update_critic(batch)  # on the home: its weights move to the next version

A trained model's weights live in its home group (where the optimizer is). Every call that
changes them (the train method, a checkpoint load) moves the home's version on; a replica holds
the version last pushed to it, and a call on it first pushes the home's weights through a weight
channel (WeightLink) when they differ. The push returns at once: the home sends after the calls
queued before it (the update), the replica loads before the calls queued after (this one).
Everything else (config, mesh, other methods) is the home group's.
"""

from __future__ import annotations

from typing import Any

WEIGHT_CHANGING = ("load_checkpoint",)
"""Home methods besides the train method after which replicas hold stale weights."""


class CallRouter:
    def __init__(self, model: str, home: Any, routes: dict[str, Any], train_method: str | None = None):
        """routes: worker method -> the replica group that runs it; train_method: the home's
        method that updates the weights (None: a frozen model, nothing is ever pushed)."""
        self._model, self._home, self._routes, self._train_method = model, home, dict(routes), train_method
        self.version = 0
        """Weight-changing calls issued on the home so far."""
        self.held: dict[str, int] = {}
        """Replica role -> the version pushed to it."""
        self._links: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if self._train_method is not None and name in (self._train_method, *WEIGHT_CHANGING):
            return lambda *args, **kwargs: self._changing(name, *args, **kwargs)
        replica = self._routes.get(name)
        if replica is None:
            return getattr(self._home, name)
        return lambda *args, **kwargs: self._on_replica(replica, name, *args, **kwargs)

    @property
    def home(self) -> Any:
        return self._home

    @property
    def routes(self) -> dict[str, Any]:
        """Worker method -> the replica group it runs on."""
        return dict(self._routes)

    def _changing(self, method: str, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self._home, method)(*args, **kwargs)
        self.version += 1
        return result

    def _on_replica(self, replica: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._train_method is not None:
            self.bring_up_to_date(replica)
        return getattr(replica, method)(*args, **kwargs)

    def bring_up_to_date(self, replica: Any) -> None:
        """Push the home's weights to `replica` unless it holds this version already (or the
        link was made between processes that have been re-created since)."""
        from workbench.workers.rollout_link import WeightLink  # the worker stack, only when used

        role = replica.role
        link = self._links.get(role)
        if link is not None and link.current() and self.held.get(role) == self.version:
            return
        if link is None or not link.current() or link.copy is not replica:
            link = self._links[role] = WeightLink(self._home, replica)
        link.push(self.version)
        self.held[role] = self.version

    def check(self) -> list[dict]:
        """Wait for every push so far; what each side moved (bytes, tensors, seconds)."""
        return [stats for link in self._links.values() for stats in link.check()]

    def __repr__(self) -> str:
        routed = ", ".join(f"{m}->{g.role}" for m, g in self._routes.items())
        return f"CallRouter({self._model!r}: home {self._home.role}, {routed}, version {self.version})"
