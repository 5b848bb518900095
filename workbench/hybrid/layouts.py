"""The 3D-HybridEngine's two layouts as data: which weights each rank holds, who gathers with
whom, and the bytes a training -> generation switch moves (HybridFlow §5, Figure 8, Table 2).

Pure functions of a `Mesh` (its training layout p-t-d, generation layout p_g-t_g-d_g-d with
d_g = micro_dp, and its `transition` method), so tests, the planner, notebooks and widgets
read the same description the collectives follow.

Shards. A tensor-parallel parameter is cut into t equal pieces along one dim, and the layers
into p contiguous pipeline stages, so one training replica (a model-parallel group of p·t
ranks) holds K = p·t training shards, indexed (pipeline stage, tensor piece). A `Shard` names
a block of them as half-open ranges: a training shard is one (pp, tp) pair; generation shard
(pp_g, tp_g) covers stages [pp_g·p/p_g, (pp_g+1)·p/p_g) and tensor pieces
[tp_g·t/t_g, (tp_g+1)·t/t_g): contiguous pieces in tensor order, so along a dim of size n it
is `slices(n, tp_g, t_g)`. Bytes treat the model as M split evenly over the p·t shards, as
Table 2 does (replicated norms and biases are small and ignored there).
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction
from numbers import Real
from typing import NamedTuple

from workbench.controller.mesh import Mesh


class Shard(NamedTuple):
    """A block of training shards: pipeline stages [pp[0], pp[1]) x tensor pieces [tp[0], tp[1])."""

    pp: tuple[int, int]
    tp: tuple[int, int]

    def contains(self, other: Shard) -> bool:
        return (self.pp[0] <= other.pp[0] and other.pp[1] <= self.pp[1]
                and self.tp[0] <= other.tp[0] and other.tp[1] <= self.tp[1])

    @property
    def pieces(self) -> list[tuple[int, int]]:
        """The (stage, tensor piece) training shards inside, stage-major."""
        return [(p, t) for p in range(*self.pp) for t in range(*self.tp)]

    def fraction(self, mesh: Mesh) -> Fraction:
        """Share of the whole model in this block."""
        return Fraction(len(self.pieces), mesh.pp * mesh.tp)


def _checked(mesh: Mesh) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"expected a workbench Mesh (pp, tp, dp, gen_pp, gen_tp, transition), "
                        f"got {type(mesh).__name__}")
    return mesh


def gen_sizes(mesh: Mesh) -> tuple[int, int]:
    """(p_g, t_g): the generation layout's pipeline and tensor sizes."""
    return mesh.gen_pp or mesh.pp, mesh.gen_tp or mesh.tp


def slices(size: int, index: int, count: int) -> tuple[int, int]:
    """[start, stop) of piece `index` of `count` equal pieces along a dim of `size`."""
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"piece index {index} of {count}: need count >= 1 and 0 <= index < count")
    if size % count:
        raise ValueError(f"a dim of size {size} does not split into {count} equal pieces: choose a "
                         f"tensor-parallel size that divides {size} (heads, hidden and vocab sizes)")
    step = size // count
    return index * step, (index + 1) * step


def train_shard(mesh: Mesh, rank: int) -> Shard:
    """The one training shard (stage pp, tensor piece tp) that `rank` trains."""
    c = _checked(mesh).coord(rank)
    return Shard((c.pp, c.pp + 1), (c.tp, c.tp + 1))


def gen_shard(mesh: Mesh, rank: int) -> Shard:
    """The training shards `rank` holds while generating (its generation (pp_g, tp_g) block)."""
    g = _checked(mesh).gen_coord(rank)
    gen_pp, gen_tp = gen_sizes(mesh)
    pp_len, tp_len = mesh.pp // gen_pp, mesh.tp // gen_tp
    return Shard((g.pp * pp_len, (g.pp + 1) * pp_len), (g.tp * tp_len, (g.tp + 1) * tp_len))


def contains_training_shard(mesh: Mesh, rank: int) -> bool:
    """Whether `rank` generates with a shard that includes the one it trains (always so for
    hybridflow: zero redundancy is possible)."""
    return gen_shard(mesh, rank).contains(train_shard(mesh, rank))


def generation_groups(mesh: Mesh) -> list[tuple[int, ...]]:
    """The ranks of each generation replica, listed by replica (0 .. dp·micro_dp-1).

    Inside a replica, the rank at generation (pp_g, tp_g) sits at index pp_g·t_g + tp_g
    (stage-major, tensor innermost, like training ranks), so a torch DeviceMesh for
    generation is `torch.tensor(groups).reshape(-1, p_g, t_g)` ([replica][pp_g][tp_g]), or
    [replica][tp_g] when p_g = 1."""
    gen_pp, gen_tp = gen_sizes(_checked(mesh))
    groups = [[None] * (gen_pp * gen_tp) for _ in range(mesh.dp * mesh.micro_dp)]
    for r in range(mesh.world_size):
        g = mesh.gen_coord(r)
        groups[g.dp][g.pp * gen_tp + g.tp] = r
    return [tuple(group) for group in groups]


def generation_tp_groups(mesh: Mesh) -> list[tuple[int, ...]]:
    """Generation tensor-parallel groups: the t_g ranks of one replica and stage, by tp_g;
    listed replica-major, then by stage."""
    gen_tp = gen_sizes(mesh)[1]
    return [group[i:i + gen_tp] for group in generation_groups(mesh)
            for i in range(0, len(group), gen_tp)]


def micro_dp_groups(mesh: Mesh) -> list[tuple[int, ...]]:
    """Ranks of one training replica that hold the same generation shard (d_g = micro_dp of
    them: one per generation replica), in rank order. Generated responses are all-gathered
    inside these groups before the update."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for r in range(_checked(mesh).world_size):
        g = mesh.gen_coord(r)
        groups.setdefault((mesh.coord(r).dp, g.pp, g.tp), []).append(r)
    return [tuple(group) for group in groups.values()]


def gather_groups(mesh: Mesh) -> list[tuple[int, ...]]:
    """The rank groups that all-gather weights together in the switch to generation; every
    rank is in exactly one, members in rank order. Gathered in that order, the parts come out
    as the block's training shards stage-major, tensor pieces in order (for deepspeed_chat:
    data-parallel copy outermost, each shard split into d consecutive parts, see
    `contribution`):

    - deepspeed_chat: all N ranks (each full model is gathered everywhere);
    - vanilla: each training TP·PP group (p·t consecutive ranks; the full model), or each
      rank alone when the generation layout is the training one (nothing to gather);
    - hybridflow: each micro-DP group (its members' training shards make up their shared
      generation shard; consecutive ranks for pure tensor parallelism)."""
    n, mp = _checked(mesh).world_size, mesh.pp * mesh.tp
    if mesh.transition == "deepspeed_chat":
        return [tuple(range(n))]
    if mesh.transition == "vanilla":
        size = mp if mesh.micro_dp > 1 else 1
        return [tuple(range(first, first + size)) for first in range(0, n, size)]
    return micro_dp_groups(mesh)


def gather_group(mesh: Mesh, rank: int) -> tuple[int, ...]:
    """The gather group `rank` belongs to."""
    _checked(mesh).coord(rank)  # range check with a clear message
    return next(g for g in gather_groups(mesh) if rank in g)


def contribution(mesh: Mesh, rank: int) -> tuple[Shard, int, int]:
    """What `rank` puts into its gather group: (its training shard, index, count) = piece
    `index` of `count` equal pieces of that shard. Members holding the same shard (the d
    data-parallel copies under deepspeed_chat) split it between them; otherwise (0, 1)."""
    return _contribution(mesh, rank, gather_group(mesh, rank))


def _contribution(mesh: Mesh, rank: int, group: tuple[int, ...]) -> tuple[Shard, int, int]:
    mine = train_shard(mesh, rank)
    twins = [r for r in group if train_shard(mesh, r) == mine]
    return mine, twins.index(rank), len(twins)


def gathered_shard(mesh: Mesh, rank: int) -> Shard:
    """The block of training shards a rank holds after the all-gather: the union of its
    group's training shards (a full rectangle, each piece equally often by construction)."""
    return _union(mesh, gather_group(mesh, rank))


def _union(mesh: Mesh, group: tuple[int, ...]) -> Shard:
    shards = [train_shard(mesh, r) for r in group]
    return Shard((min(s.pp[0] for s in shards), max(s.pp[1] for s in shards)),
                 (min(s.tp[0] for s in shards), max(s.tp[1] for s in shards)))


class RankTransfer(NamedTuple):
    """One rank's weight bytes in a training -> generation switch."""

    rank: int
    received: float
    """Bytes received in the all-gather: what the group gathers minus the rank's own part."""
    sent: float
    """Bytes sent, counted for a ring all-gather: g-1 parts of c bytes (its own, then the g-2
    it relays), so (g-1)·c, equal to what it receives."""
    peak_params: float
    """Parameter bytes at the switch's peak: the gathered block (own part included)."""
    redundant: float
    """Training bytes kept beside the generation shard while generating."""
    generation_params: float
    """The generation shard, M/(p_g·t_g)."""


def _kept_beside(mesh: Mesh, group: tuple[int, ...]) -> bool:
    """Whether the training part waits in its own buffer while the rank generates."""
    if mesh.transition == "hybridflow":
        return False  # the generation shard is gathered around the training shard it contains
    if mesh.transition == "vanilla":
        return len(group) > 1  # with no layout change the training shard serves as is
    return True  # deepspeed_chat keeps its ZeRO partition (1/d of its training shard)


def transition_bytes(mesh: Mesh, model_bytes: Real) -> list[RankTransfer]:
    """Per rank (list index = rank): the bytes of the switch to generation for a model of
    `model_bytes` (M), derived from `gather_groups` and `contribution`, not from Table 2's
    formulas (a test checks they agree). A group of g members each adding c bytes: received
    (g-1)·c, sent (g-1)·c (ring convention: every member forwards each other part once),
    peak g·c. Exact (int) where M divides evenly, else float."""
    if not isinstance(model_bytes, Real) or isinstance(model_bytes, bool) or model_bytes < 0:
        raise ValueError(f"model_bytes={model_bytes!r}: give the model's size in bytes (>= 0)")
    m = Fraction(model_bytes)
    out = []
    group_of = {r: g for g in gather_groups(_checked(mesh)) for r in g}
    blocks = {g: _union(mesh, g).fraction(mesh) * m for g in set(group_of.values())}
    shards = [train_shard(mesh, r) for r in range(mesh.world_size)]
    copies = Counter((group_of[r], shards[r]) for r in range(mesh.world_size))
    for r in range(mesh.world_size):
        group = group_of[r]
        part = shards[r].fraction(mesh) / copies[group, shards[r]] * m  # copies split a shard
        gathered = blocks[group]
        assert gathered == len(group) * part, "gather group does not tile its block evenly"
        out.append(RankTransfer(
            rank=r, received=_num(gathered - part), sent=_num((len(group) - 1) * part),
            peak_params=_num(gathered), redundant=_num(part if _kept_beside(mesh, group) else 0),
            generation_params=_num(gen_shard(mesh, r).fraction(mesh) * m)))
    return out


def _num(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


RANK_MAP_KEYS = ("rank", "train_pp", "train_tp", "train_dp", "train_shard", "gen_replica",
                 "gen_pp", "gen_tp", "gen_shard", "micro_dp_group", "gather_group",
                 "contains_training_shard")
"""Keys of every `rank_map` row, in order (stable: notebooks and widgets read them)."""


def rank_map(mesh: Mesh) -> list[dict]:
    """One row per rank, the data behind a HybridFlow Figure 8 picture:

    rank; train_pp, train_tp, train_dp (training coordinates); train_shard (Shard);
    gen_replica, gen_pp, gen_tp (generation replica and coordinates in it); gen_shard (Shard);
    micro_dp_group and gather_group (tuples of ranks); contains_training_shard (bool).
    Shards are ((stage start, stop), (piece start, stop)) in training-shard indices."""
    micro = {r: g for g in micro_dp_groups(mesh) for r in g}
    gather = {r: g for g in gather_groups(mesh) for r in g}
    rows = []
    for r in range(mesh.world_size):
        c, g = mesh.coord(r), mesh.gen_coord(r)
        rows.append(dict(zip(RANK_MAP_KEYS, (
            r, c.pp, c.tp, c.dp, train_shard(mesh, r), g.dp, g.pp, g.tp, gen_shard(mesh, r),
            micro[r], gather[r], contains_training_shard(mesh, r)))))
    return rows
