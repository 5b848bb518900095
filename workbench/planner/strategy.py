"""3-D parallel strategies (pipeline, tensor, data) and which ones a model admits.

Rank layout assumed everywhere (Megatron order): tensor-parallel ranks innermost, then data
parallel, pipeline stages outermost. So a TP group is `tp` consecutive devices (inside one
machine), a DP group spans `tp·dp` consecutive devices, and each pipeline stage owns a
contiguous block of `tp·dp` devices.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from workbench.planner.specs import ClusterSpec, ModelSpec


@dataclass(frozen=True, order=True)
class ParallelStrategy:
    """How one model (or one call) is split over its devices."""

    pp: int
    """Pipeline stages (layers split into `pp` contiguous blocks)."""
    tp: int
    """Tensor-parallel degree (heads and MLP columns split; needs fast intra-node links)."""
    dp: int
    """Data-parallel replicas."""

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def model_parallel(self) -> int:
        """Devices holding one copy of the weights."""
        return self.pp * self.tp

    def __str__(self) -> str:
        return f"p{self.pp}t{self.tp}d{self.dp}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@lru_cache(maxsize=None)
def strategies(spec: ModelSpec, n_devices: int, devices_per_node: int) -> tuple[ParallelStrategy, ...]:
    """All (pp, tp, dp) with pp·tp·dp = n_devices that the model admits: tp divides the query
    and KV heads and a machine (TP stays in one node), pp divides the layers."""
    out = []
    for tp in _divisors(n_devices):
        if tp > devices_per_node or devices_per_node % tp or spec.n_heads % tp \
                or spec.n_kv_heads % tp:
            continue
        for pp in _divisors(n_devices // tp):
            if spec.n_layers % pp:
                continue
            out.append(ParallelStrategy(pp, tp, n_devices // (pp * tp)))
    return tuple(out)


def generation_strategies(train: ParallelStrategy) -> list[ParallelStrategy]:
    """3D-HybridEngine generation layouts for a training layout (HybridFlow §5):
    p_g | p and t_g | t, with d_g·d replicas so the device count is unchanged."""
    return [ParallelStrategy(pg, tg, train.world // (pg * tg))
            for pg in _divisors(train.pp) for tg in _divisors(train.tp)]


def dp_members_per_node(s: ParallelStrategy, cluster: ClusterSpec) -> int:
    """How many members of one DP group share a machine (hierarchical collectives reduce
    inside the machine first)."""
    return max(1, min(s.dp, cluster.devices_per_node // s.tp))


def crosses_nodes(n_consecutive: int, cluster: ClusterSpec) -> bool:
    return n_consecutive > cluster.devices_per_node
