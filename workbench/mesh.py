"""Mesh: a (pp, tp, dp) parallel layout, and each rank's coordinates in it.

The workbench's one layout type: worker groups, dispatch protocols and the hybrid engine run
on it, and the planner proposes and costs it.

Rank order (the one the runtime uses everywhere): tensor parallelism innermost, then
pipeline, then data parallelism outermost:
    rank = (dp * pp_size + pp) * tp_size + tp
so one data-parallel replica (a model-parallel group of pp*tp ranks) is a block of
consecutive ranks, a tensor-parallel group is a run of tp consecutive ranks inside it, the
stages of a pipeline are tp ranks apart, and data-parallel peers are pp*tp ranks apart.
Ranks fill machines in order, so a tensor-parallel group stays in one machine when tp
divides the machine, and a whole replica does when pp*tp does; data-parallel collectives are
the ones that cross machines first (`dp_peers_per_node`, `replica_spans_nodes`).

A mesh may also name a *generation* layout (gen_pp, gen_tp) for the hybrid engine
(HybridFlow §5): each training replica then holds micro_dp = (pp*tp)/(gen_pp*gen_tp)
generation replicas. How the ranks of a training replica form generation groups is the
mesh's `transition` method (HybridFlow Table 2):
- "hybridflow": generation TP/PP groups take ranks at a stride (tp/gen_tp, pp/gen_pp) inside
  the training group and micro-DP groups are consecutive ranks, so every rank's generation
  shard contains its training shard (zero redundancy);
- "vanilla" and "deepspeed_chat": generation groups are formed like the training groups
  (a generation TP group is gen_tp consecutive ranks, a generation PP group gen_pp
  consecutive stages), so some ranks generate with weights they did not train.
`workbench.layouts` derives the shards, gather groups and bytes from these.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from functools import total_ordering
from typing import NamedTuple

from workbench import checks

TRANSITION_METHODS: tuple[str, ...] = ("deepspeed_chat", "vanilla", "hybridflow")
"""How the actor switches from its training to its generation layout (HybridFlow Table 2)."""


class Coord(NamedTuple):
    pp: int
    tp: int
    dp: int


@total_ordering
@dataclass(frozen=True)
class Mesh:
    """Sizes of the pipeline (pp), tensor (tp) and data (dp) parallel dimensions, in that
    order (`Mesh(1, 2, 4)` is pp=1, tp=2, dp=4), ranks laid out as the module says. Meshes
    sort by (pp, tp, dp), then by their generation layout."""

    pp: int = 1
    tp: int = 1
    dp: int = 1
    gen_pp: int | None = None
    """Pipeline size of the generation layout (hybrid engine); None = same as training."""
    gen_tp: int | None = None
    """Tensor-parallel size of the generation layout (hybrid engine); None = same as training."""
    transition: str = "hybridflow"
    """How generation groups are formed from the training ranks: one of TRANSITION_METHODS
    ("hybridflow": strided generation groups, zero redundancy; "vanilla" / "deepspeed_chat":
    generation groups formed like the training groups)."""

    def __post_init__(self):
        checks.one_of(
            "Mesh",
            "transition",
            self.transition,
            TRANSITION_METHODS,
            fix=f"use one of {', '.join(map(repr, TRANSITION_METHODS))}",
        )
        for name in ("pp", "tp", "dp", "gen_pp", "gen_tp"):
            checks.whole(
                "Mesh",
                name,
                getattr(self, name),
                none_ok=name.startswith("gen_"),
                fix="must be >= 1: use a whole number of ranks",
            )
        gen_pp, gen_tp = self.gen_pp or self.pp, self.gen_tp or self.tp
        if self.pp % gen_pp or self.tp % gen_tp:
            raise ValueError(
                f"generation layout (gen_pp={gen_pp}, gen_tp={gen_tp}) must divide the training "
                f"layout (pp={self.pp}, tp={self.tp}): generation may only shrink model parallelism"
            )

    @classmethod
    def data_parallel(cls, world_size: int) -> Mesh:
        return cls(dp=world_size)

    @classmethod
    def for_world(cls, world_size: int, pp: int = 1, tp: int = 1, **gen) -> Mesh:
        """The mesh with the given pp and tp that fills world_size ranks (dp derived)."""
        if world_size % (pp * tp):
            raise ValueError(
                f"pp*tp = {pp}*{tp} = {pp * tp} does not divide the {world_size} devices of the "
                f"pool; choose sizes whose product divides {world_size}"
            )
        return cls(pp=pp, tp=tp, dp=world_size // (pp * tp), **gen)

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def model_parallel(self) -> int:
        """Ranks of one data-parallel replica, pp*tp consecutive ranks that together hold one
        copy of the weights."""
        return self.pp * self.tp

    # ---- where ranks sit on machines (ranks fill machines in order) ---------------------
    def dp_peers_per_node(self, devices_per_node: int) -> int:
        """How many ranks of a data-parallel group share a machine of `devices_per_node`
        devices (peers are pp*tp ranks apart): the fewest on any machine a group uses, which
        bounds a hierarchical collective that reduces inside each machine first."""
        mp, u = self.model_parallel, devices_per_node
        fewest = self.dp
        for first in range(mp):  # one data-parallel group per position in the replica
            per_machine = Counter((first + k * mp) // u for k in range(self.dp))
            fewest = min(fewest, *per_machine.values())
        return fewest

    def replica_spans_nodes(self, devices_per_node: int) -> bool:
        """Whether some data-parallel replica (pp*tp consecutive ranks) spans machines, so its
        pipeline hops cross them."""
        mp = self.model_parallel
        return any(
            first // devices_per_node != (first + mp - 1) // devices_per_node for first in range(0, self.world_size, mp)
        )

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside a mesh of {self.world_size} ranks")
        tp = rank % self.tp
        pp = (rank // self.tp) % self.pp
        dp = rank // (self.tp * self.pp)
        return Coord(pp=pp, tp=tp, dp=dp)

    def rank(self, pp: int = 0, tp: int = 0, dp: int = 0) -> int:
        return (dp * self.pp + pp) * self.tp + tp

    # ---- generation layout (hybrid engine) ----------------------------------------------
    @property
    def micro_dp(self) -> int:
        """Generation replicas per training replica: (pp*tp) / (gen_pp*gen_tp)."""
        return (self.pp * self.tp) // ((self.gen_pp or self.pp) * (self.gen_tp or self.tp))

    def gen_replica(self, rank: int) -> int:
        """Index of the generation replica (0 .. dp*micro_dp-1) this rank serves in."""
        return self.gen_coord(rank).dp

    def gen_coord(self, rank: int) -> Coord:
        """Coordinates of this rank inside its generation replica (pp, tp, replica).

        Per dimension, a training coordinate c splits into a generation coordinate and a
        micro-replica index. hybridflow: (c // stride, c % stride), so a generation group
        takes every stride-th rank; vanilla / deepspeed_chat: (c % gen_size, c // gen_size),
        so it takes consecutive ranks. Micro-replicas count tensor blocks innermost."""
        c = self.coord(rank)
        gen_tp, gen_pp = self.gen_tp or self.tp, self.gen_pp or self.pp
        tp_stride, pp_stride = self.tp // gen_tp, self.pp // gen_pp
        if self.transition == "hybridflow":
            (g_tp, m_tp), (g_pp, m_pp) = divmod(c.tp, tp_stride), divmod(c.pp, pp_stride)
        else:
            (m_tp, g_tp), (m_pp, g_pp) = divmod(c.tp, gen_tp), divmod(c.pp, gen_pp)
        micro = m_pp * tp_stride + m_tp
        return Coord(pp=g_pp, tp=g_tp, dp=c.dp * self.micro_dp + micro)

    def with_generation(self, gen: Mesh, transition: str = "hybridflow") -> Mesh:
        """This training layout generating in `gen`'s (pp, tp) on the same ranks (the planner
        proposes the generation layout as a mesh of its own, dp = micro_dp * this dp)."""
        if gen.world_size != self.world_size:
            raise ValueError(
                f"generation layout {gen.short()} has {gen.world_size} ranks, the training "
                f"layout {self.short()} {self.world_size}: both use the same ranks"
            )
        return dataclasses.replace(self, gen_pp=gen.pp, gen_tp=gen.tp, transition=transition)

    def _sort_key(self) -> tuple:
        # No generation layout (None) sorts first; equal keys iff equal meshes.
        return (self.pp, self.tp, self.dp, self.gen_pp or 0, self.gen_tp or 0, self.transition)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Mesh):
            return NotImplemented
        return self._sort_key() < other._sort_key()

    def short(self) -> str:
        """Compact form, as the planner prints layouts: "p1t2d4", and with a generation
        layout "p1t4d2|p1t2d4" (generation pp, tp and replicas after the bar)."""
        text = f"p{self.pp}t{self.tp}d{self.dp}"
        if self.gen_pp or self.gen_tp:
            text += f"|p{self.gen_pp or self.pp}t{self.gen_tp or self.tp}d{self.dp * self.micro_dp}"
        return text

    def __str__(self) -> str:
        gen = ""
        if self.gen_pp or self.gen_tp:
            gen = f", gen pp={self.gen_pp or self.pp} tp={self.gen_tp or self.tp}"
            if self.transition != "hybridflow":
                gen += f" ({self.transition})"
        return f"Mesh(pp={self.pp}, tp={self.tp}, dp={self.dp}{gen})"
