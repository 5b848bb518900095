"""Which 3-D layouts (pipeline, tensor, data) a model admits on n devices.

A layout is a `workbench.mesh.Mesh`, the type the runtime runs, with the runtime's
rank order (tensor innermost, then pipeline, data parallelism outermost): a TP group is `tp`
consecutive devices (kept inside one machine), one data-parallel replica `pp·tp` consecutive
devices, and data-parallel peers are `pp·tp` devices apart. The simulator asks the mesh where
its groups sit (`Mesh.dp_peers_per_node`, `Mesh.replica_spans_nodes`).
"""

from __future__ import annotations

from functools import cache

from workbench.mesh import Mesh
from workbench.planner.specs import ModelSpec


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@cache
def strategies(spec: ModelSpec, n_devices: int, devices_per_node: int) -> tuple[Mesh, ...]:
    """All (pp, tp, dp) with pp·tp·dp = n_devices that the model admits: tp divides the query
    and KV heads and a machine (TP stays in one node), pp divides the layers."""
    out = []
    for tp in _divisors(n_devices):
        if tp > devices_per_node or devices_per_node % tp or spec.n_heads % tp or spec.n_kv_heads % tp:
            continue
        for pp in _divisors(n_devices // tp):
            if spec.n_layers % pp:
                continue
            out.append(Mesh(pp, tp, n_devices // (pp * tp)))
    return tuple(out)


def generation_strategies(train: Mesh) -> list[Mesh]:
    """3D-HybridEngine generation layouts for a training layout (HybridFlow §5):
    p_g | p and t_g | t, with d_g·d replicas so the device count is unchanged."""
    return [Mesh(pg, tg, train.world_size // (pg * tg)) for pg in _divisors(train.pp) for tg in _divisors(train.tp)]


def is_generation_layout(train: Mesh, gen: Mesh) -> bool:
    """Whether the hybrid engine can switch `train` to `gen` on the same devices."""
    return gen.world_size == train.world_size and train.pp % gen.pp == 0 and train.tp % gen.tp == 0
