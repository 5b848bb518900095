"""A trained worker's in-memory snapshots (workbench.engines.snapshot) under names: the registered
methods behind `Algorithm.snapshot()` / `restore(snapshot)`, a rewind without files. Each rank
holds its own part (its shards, its optimizer partition, its random generators and counters), so
nothing travels through the driver.

Mixed into the trained workers (actor, critic); the worker supplies `_trained()` (its engine),
`_counters()` (what else a step moves, e.g. the actor's update count) and `_restored(counters)`."""

from __future__ import annotations

from typing import Any

from workbench.controller import ONE_TO_ALL, register
from workbench.engines import snapshot as engine_snapshot
from workbench.workers.updates import rng_state, set_rng_state


class Snapshots:
    """Registered snapshot/restore_snapshot/drop_snapshot/state_digest."""

    def _held(self) -> dict:
        if not hasattr(self, "_snapshots"):
            self._snapshots: dict[str, tuple] = {}
        return self._snapshots

    @register(ONE_TO_ALL)
    def snapshot(self, name: str) -> int:
        """Hold the trained weights, optimizer state, random generators and counters under
        `name` in this process (a name taken again is replaced); the bytes held."""
        held = engine_snapshot.take(self._trained())
        self._held()[name] = (held, rng_state(), self._counters())
        return held.nbytes()

    @register(ONE_TO_ALL)
    def restore_snapshot(self, name: str) -> str:
        """Put back what `snapshot(name)` held; it stays held (restore it again, or drop it)."""
        if name not in self._held():
            raise KeyError(f"no snapshot named {name!r} on this worker; held: {sorted(self._held())}")
        held, rng, counters = self._held()[name]
        engine_snapshot.restore(self._trained(), held)
        set_rng_state(rng)
        self._restored(counters)
        return name

    @register(ONE_TO_ALL)
    def drop_snapshot(self, name: str) -> bool:
        """Free a snapshot's memory; False when none was held under `name`."""
        return self._held().pop(name, None) is not None

    @register(ONE_TO_ALL)
    def state_digest(self) -> str:
        """A hash of this rank's trained weights and optimizer state: equal, bit for bit."""
        return engine_snapshot.digest(self._trained())

    def _trained(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} keeps snapshots of its engine: give it a _trained()")

    def _counters(self) -> dict:
        return {}

    def _restored(self, counters: dict) -> None:
        pass
