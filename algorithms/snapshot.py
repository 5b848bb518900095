"""In-memory snapshots of a run: a checkpoint without files, coordinated by the single controller.

    taken = algo.snapshot()     # every trained group holds its state in its own processes
    ...                         # steps with an edited loss, a new estimator, anything
    algo.restore(taken)         # the next step is the one that followed the snapshot, bit for bit
    algo.drop(taken)            # free the workers' memory

Each trained group's ranks keep their own part (workbench.engines.snapshot: shards, master
weights, optimizer moments) with their random generators and counters (the workers' registered
`snapshot` / `restore_snapshot`); the driver keeps the algorithm's `state_dict()` and its random
generators. `workbench.run.checkpoint.RunCheckpointer` is the same through files, for runs that
outlive their processes.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Any

from workbench.errors import ConfigError
from workbench.workers.updates import rng_state, set_rng_state

TRAINED_ROLES = ("actor", "critic", "cost_critic")
"""The roles whose weights change during a run (reference, reward and cost models are frozen)."""


def trained_groups(algorithm) -> dict[str, Any]:
    """{role: group} for the algorithm's groups whose weights train."""
    groups = {}
    for role in TRAINED_ROLES:
        group = getattr(algorithm.groups, role, None)
        if group is None:
            continue
        if "save_checkpoint" not in getattr(group, "methods", ()):
            raise ConfigError(
                f"{type(algorithm).__name__} role {role!r}",
                type(group).__name__,
                "a trained role needs a worker group with save_checkpoint/load_checkpoint",
            )
        groups[role] = group
    return groups


_snapshot_ids = itertools.count(1)
_dropped: set[str] = set()


@dataclass(frozen=True)
class RunSnapshot:
    """What `snapshot(algorithm)` took: each trained group holds its part in its own processes
    under `name`; the driver's part is here."""

    name: str
    roles: tuple[str, ...]
    algorithm_class: str
    algorithm_state: dict[str, Any] = field(repr=False)
    rng: dict[str, Any] = field(repr=False)
    nbytes: int = 0
    """Bytes the workers hold for it (every rank of every trained group)."""


def snapshot(algorithm) -> RunSnapshot:
    """Every trained group's weights, optimizer state, random generators and counters, held in
    its own processes, and the driver's state: `restore_snapshot` rewinds the run to here. The
    in-memory twin of RunCheckpointer.save (no files; gone with the processes)."""
    groups = trained_groups(algorithm)
    name = f"snapshot-{next(_snapshot_ids)}"
    futures = {role: group.snapshot(name) for role, group in groups.items()}
    held = sum(sum(future.get()) for future in futures.values())
    state = copy.deepcopy(algorithm.state_dict())
    return RunSnapshot(name, tuple(sorted(groups)), type(algorithm).__name__, state, rng_state(), held)


def restore_snapshot(algorithm, taken: RunSnapshot) -> None:
    """Put every trained group and the driver back as they were at `taken` (it stays held: a
    cell can rewind to it again)."""
    groups = trained_groups(algorithm)
    if taken.name in _dropped:
        raise ConfigError("restore snapshot", taken.name, "it was dropped (its memory freed); take a new one")
    if taken.algorithm_class != type(algorithm).__name__ or taken.roles != tuple(sorted(groups)):
        raise ConfigError(
            "restore snapshot",
            taken.name,
            f"it was taken of a {taken.algorithm_class} with trained roles {list(taken.roles)}; this is a "
            f"{type(algorithm).__name__} with {sorted(groups)}: restore it into the algorithm it was taken of",
        )
    for future in [group.restore_snapshot(taken.name) for group in groups.values()]:
        future.get()
    algorithm.load_state_dict(copy.deepcopy(taken.algorithm_state))
    set_rng_state(taken.rng)


def drop_snapshot(algorithm, taken: RunSnapshot) -> None:
    """Free the workers' memory for `taken`."""
    _dropped.add(taken.name)
    for future in [group.drop_snapshot(taken.name) for group in trained_groups(algorithm).values()]:
        future.get()
