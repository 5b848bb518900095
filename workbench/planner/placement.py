"""Where a plan puts each model: colocated sets (one resource pool each), the devices they take
machine by machine, and each model's (pp, tp, dp) layout inside its set.

The pieces of a `Plan` that running it needs (`deploy`), apart from its cost estimates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workbench.mesh import Mesh
from workbench.planner.memory import MemoryBreakdown, Transition
from workbench.planner.specs import ModelSpec


@dataclass(frozen=True)
class ModelAssignment:
    """One model's layout inside its colocated set."""

    model: str
    """Role name ('actor', 'critic', ...)."""
    spec: ModelSpec
    """Architecture."""
    strategy: Mesh
    """Layout for training and inference calls (its world = the set's device count)."""
    generation: Mesh | None = None
    """Actor only: 3D-HybridEngine generation layout (p_g, t_g, d_g·d) on the same devices."""
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    """Per-device static memory plus the peak dynamic memory of this model's calls."""
    transition: Transition | None = None
    """Actor only: the training -> generation switch (HybridFlow Table 2 bytes and memory)."""


@dataclass(frozen=True)
class ColocatedSet:
    """Models that time-share the same devices (one resource pool)."""

    name: str
    """Pool name, e.g. 'actor+reference'."""
    models: tuple[str, ...]
    """Roles in the set, in dataflow order."""
    first_device: int
    """Global index of the set's first device (sets are packed node by node)."""
    n_devices: int
    """Devices allocated to the set."""
    devices_per_node: tuple[int, ...]
    """Devices taken on each machine the set touches: `ResourcePool(devices_per_node=...)`."""
    nodes: tuple[int, ...]
    """Indices of those machines."""
    assignments: dict[str, ModelAssignment]
    """Layout per model."""
    peak_memory: float
    """Per-device peak: static memory of all models + the largest call's dynamic memory."""

    @property
    def devices(self) -> range:
        return range(self.first_device, self.first_device + self.n_devices)


def span(first: int, k: int, devices_per_node: int) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """First device, per-node counts and node indices of k devices starting at device `first`."""
    counts, nodes, d = [], [], first
    while d < first + k:
        node = d // devices_per_node
        take = min(first + k, (node + 1) * devices_per_node) - d
        counts.append(take)
        nodes.append(node)
        d += take
    return first, tuple(counts), tuple(nodes)


def pack_sets(sizes: list[int], devices_per_node: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """First device, per-node counts and node indices of sets laid out one after another."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [span(start, n, devices_per_node) for start, n in zip(starts, sizes)]
