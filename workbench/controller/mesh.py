"""Mesh: the parallel layout of one worker group, and each rank's coordinates in it.

Ranks are laid out with tensor parallelism innermost, then pipeline, then data parallelism:
    rank = (dp * pp_size + pp) * tp_size + tp
so one data-parallel replica (a model-parallel group of pp*tp ranks) is a block of
consecutive ranks, and a tensor-parallel group is a run of consecutive ranks inside it.

A mesh may also name a *generation* layout (gen_pp, gen_tp) for the hybrid engine
(HybridFlow §5): each training replica then holds micro_dp = (pp*tp)/(gen_pp*gen_tp)
generation replicas. Generation TP/PP groups take ranks at a stride (tp/gen_tp, pp/gen_pp)
inside the training group and micro-DP groups are consecutive ranks, so every rank's
generation shard contains its training shard (zero redundancy).
"""

from __future__ import annotations

from dataclasses import dataclass
import numbers
from typing import NamedTuple

from workbench.errors import ConfigError


class Coord(NamedTuple):
    pp: int
    tp: int
    dp: int


@dataclass(frozen=True)
class Mesh:
    """Sizes of the pipeline (pp), tensor (tp) and data (dp) parallel dimensions."""

    pp: int = 1
    tp: int = 1
    dp: int = 1
    gen_pp: int | None = None
    """Pipeline size of the generation layout (hybrid engine); None = same as training."""
    gen_tp: int | None = None
    """Tensor-parallel size of the generation layout (hybrid engine); None = same as training."""

    def __post_init__(self):
        for name in ("pp", "tp", "dp", "gen_pp", "gen_tp"):
            value = getattr(self, name)
            if value is None and name.startswith("gen_"):
                continue
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"Mesh.{name}", value, "must be >= 1: use a whole number of ranks")
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
        c = self.coord(rank)
        tp_stride = self.tp // (self.gen_tp or self.tp)
        pp_stride = self.pp // (self.gen_pp or self.pp)
        micro = (c.pp % pp_stride) * tp_stride + (c.tp % tp_stride)
        return c.dp * self.micro_dp + micro

    def gen_coord(self, rank: int) -> Coord:
        """Coordinates of this rank inside its generation replica (pp, tp, replica)."""
        c = self.coord(rank)
        tp_stride = self.tp // (self.gen_tp or self.tp)
        pp_stride = self.pp // (self.gen_pp or self.pp)
        return Coord(pp=c.pp // pp_stride, tp=c.tp // tp_stride, dp=self.gen_replica(rank))

    def __str__(self) -> str:
        gen = ""
        if self.gen_pp or self.gen_tp:
            gen = f", gen pp={self.gen_pp or self.pp} tp={self.gen_tp or self.tp}"
        return f"Mesh(pp={self.pp}, tp={self.tp}, dp={self.dp}{gen})"
