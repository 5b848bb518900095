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

from workbench.mesh import Mesh


class Shard(NamedTuple):
    """A block of training shards: pipeline stages [pp[0], pp[1]) x tensor pieces [tp[0], tp[1])."""

    pp: tuple[int, int]
    tp: tuple[int, int]

    def contains(self, other: Shard) -> bool:
        return (
            self.pp[0] <= other.pp[0]
            and other.pp[1] <= self.pp[1]
            and self.tp[0] <= other.tp[0]
            and other.tp[1] <= self.tp[1]
        )

    @property
    def pieces(self) -> list[tuple[int, int]]:
        """The (stage, tensor piece) training shards inside, stage-major."""
        return [(p, t) for p in range(*self.pp) for t in range(*self.tp)]

    def fraction(self, mesh: Mesh) -> Fraction:
        """Share of the whole model in this block."""
        return Fraction(len(self.pieces), mesh.pp * mesh.tp)


def _checked(mesh: Mesh) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"expected a workbench Mesh (pp, tp, dp, gen_pp, gen_tp, transition), got {type(mesh).__name__}"
        )
    return mesh


def gen_sizes(mesh: Mesh) -> tuple[int, int]:
    """(p_g, t_g): the generation layout's pipeline and tensor sizes."""
    return mesh.gen_pp or mesh.pp, mesh.gen_tp or mesh.tp


def slices(size: int, index: int, count: int) -> tuple[int, int]:
    """[start, stop) of piece `index` of `count` equal pieces along a dim of `size`."""
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"piece index {index} of {count}: need count >= 1 and 0 <= index < count")
    if size % count:
        raise ValueError(
            f"a dim of size {size} does not split into {count} equal pieces: choose a "
            f"tensor-parallel size that divides {size} (heads, hidden and vocab sizes)"
        )
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
    groups: list[list[int | None]] = [[None] * (gen_pp * gen_tp) for _ in range(mesh.dp * mesh.micro_dp)]
    for r in range(mesh.world_size):
        g = mesh.gen_coord(r)
        groups[g.dp][g.pp * gen_tp + g.tp] = r
    out: list[tuple[int, ...]] = []
    for group in groups:
        ranks = tuple(r for r in group if r is not None)
        if len(ranks) != len(group):  # gen_coord is a bijection on a checked mesh, so every slot is filled
            raise AssertionError(f"{mesh}: generation replica with an empty slot: {group}")
        out.append(ranks)
    return out


def generation_tp_groups(mesh: Mesh) -> list[tuple[int, ...]]:
    """Generation tensor-parallel groups: the t_g ranks of one replica and stage, by tp_g;
    listed replica-major, then by stage."""
    gen_tp = gen_sizes(mesh)[1]
    return [group[i : i + gen_tp] for group in generation_groups(mesh) for i in range(0, len(group), gen_tp)]


def micro_dp_groups(mesh: Mesh) -> list[tuple[int, ...]]:
    """Ranks of one training replica that hold the same generation shard (d_g = micro_dp of
    them: one per generation replica), in rank order. Generated responses are all-gathered
    inside these groups before the update."""
    # Generation coordinates repeat in every training replica (mp consecutive ranks): group
    # the first replica's ranks and shift the groups to the others.
    mp = _checked(mesh).pp * mesh.tp
    first: dict[tuple[int, int], list[int]] = {}
    for r in range(mp):
        g = mesh.gen_coord(r)
        first.setdefault((g.pp, g.tp), []).append(r)
    return [tuple(base + r for r in group) for base in range(0, mesh.world_size, mp) for group in first.values()]


def gather_groups(mesh: Mesh) -> list[tuple[int, ...]]:
    """The rank groups that all-gather weights together in the switch to generation (each
    rank's `gather_group`); every rank is in exactly one, members in rank order. Gathered in
    that order, the parts come out as the block's training shards stage-major, tensor pieces
    in order (for deepspeed_chat: data-parallel copy outermost, each shard split into d
    consecutive parts, see `contribution`)."""
    n = _checked(mesh).world_size
    if mesh.transition == "hybridflow":
        return micro_dp_groups(mesh)  # one pass over the ranks
    size = len(gather_group(mesh, 0))  # the other methods gather in equal runs of consecutive ranks
    return [tuple(range(first, first + size)) for first in range(0, n, size)]


def gather_group(mesh: Mesh, rank: int) -> tuple[int, ...]:
    """The ranks `rank` all-gathers weights with in the switch to generation, in rank order:

    - deepspeed_chat: all N ranks (each full model is gathered everywhere);
    - vanilla: its training TP·PP group (p·t consecutive ranks; the full model), or itself
      alone when the generation layout is the training one (nothing to gather);
    - hybridflow: its micro-DP group (the members' training shards make up their shared
      generation shard; consecutive ranks for pure tensor parallelism)."""
    _checked(mesh).coord(rank)  # range check with a clear message
    mp = mesh.pp * mesh.tp
    if mesh.transition == "deepspeed_chat":
        return tuple(range(mesh.world_size))
    if mesh.transition == "vanilla":
        size = mp if mesh.micro_dp > 1 else 1
        return tuple(range(rank - rank % size, rank - rank % size + size))
    # hybridflow: the ranks of its training replica (mp consecutive ranks) at the same
    # generation coordinates
    mine, first = mesh.gen_coord(rank)[:2], rank - rank % mp
    return tuple(r for r in range(first, first + mp) if mesh.gen_coord(r)[:2] == mine)


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
    return Shard(
        (min(s.pp[0] for s in shards), max(s.pp[1] for s in shards)),
        (min(s.tp[0] for s in shards), max(s.tp[1] for s in shards)),
    )


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


def transition_bytes(mesh: Mesh, model_bytes: float) -> list[RankTransfer]:
    """Per rank (list index = rank): the bytes of the switch to generation for a model of
    `model_bytes` (M), derived from `gather_groups` and `contribution`, not from Table 2's
    formulas (tests check they agree). A group of g members each adding c bytes: received
    (g-1)·c, sent (g-1)·c (ring convention: every member forwards each other part once),
    peak g·c. Exact (int) where M divides evenly, else float.

    This is the workbench's one count of the switch: the planner's memory model and
    simulators read it (`workbench.planner.memory.transition`). For training layout p-t-d
    and generation p_g-t_g it comes to HybridFlow Table 2, on every rank:

    | method         | all-gather over | received                    | peak        | redundant |
    | deepspeed_chat | all N = p·t·d   | (N-1)/N·M                   | M           | M/N       |
    | vanilla        | the TP·PP group | (p·t-1)/(p·t)·M             | M           | M/(p·t)   |
    | hybridflow     | micro-DP group  | (p·t-p_g·t_g)/(p_g·t_g·p·t)·M | M/(p_g·t_g) | 0         |

    vanilla and hybridflow move and keep nothing when the generation layout is the training
    one (peak = the training shard M/(p·t))."""
    m = _model_bytes(model_bytes)
    group_of = {r: g for g in gather_groups(_checked(mesh)) for r in g}
    blocks = {g: _union(mesh, g) for g in set(group_of.values())}
    shards = [train_shard(mesh, r) for r in range(mesh.world_size)]
    copies = Counter((group_of[r], shards[r]) for r in range(mesh.world_size))
    return [
        _transfer(mesh, m, r, group_of[r], blocks[group_of[r]], copies[group_of[r], shards[r]])
        for r in range(mesh.world_size)
    ]


def rank_transfer(mesh: Mesh, model_bytes: float, rank: int) -> RankTransfer:
    """Row `rank` of `transition_bytes`, derived from that rank's gather group alone (cheap on
    large meshes: the planner reads one rank's bytes per layout, every rank's being alike)."""
    m = _model_bytes(model_bytes)
    group = gather_group(_checked(mesh), rank)
    mine = train_shard(mesh, rank)
    copies = sum(train_shard(mesh, r) == mine for r in group)
    return _transfer(mesh, m, rank, group, _union(mesh, group), copies)


def _model_bytes(model_bytes: float) -> Fraction:
    if not isinstance(model_bytes, Real) or isinstance(model_bytes, bool) or model_bytes < 0:
        raise ValueError(f"model_bytes={model_bytes!r}: give the model's size in bytes (>= 0)")
    return Fraction(model_bytes)


def _transfer(mesh: Mesh, m: Fraction, rank: int, group: tuple[int, ...], block: Shard, copies: int) -> RankTransfer:
    """A rank's bytes when its group gathers `block` and `copies` members (itself included)
    split its training shard between them."""
    part = train_shard(mesh, rank).fraction(mesh) / copies * m
    gathered = block.fraction(mesh) * m
    assert gathered == len(group) * part, "gather group does not tile its block evenly"
    return RankTransfer(
        rank=rank,
        received=_num(gathered - part),
        sent=_num((len(group) - 1) * part),
        peak_params=_num(gathered),
        redundant=_num(part if _kept_beside(mesh, group) else 0),
        generation_params=_num(gen_shard(mesh, rank).fraction(mesh) * m),
    )


def _num(x: Fraction | int) -> int | float:
    return int(x) if Fraction(x).denominator == 1 else float(x)


RANK_MAP_KEYS = (
    "rank",
    "train_pp",
    "train_tp",
    "train_dp",
    "train_shard",
    "gen_replica",
    "gen_pp",
    "gen_tp",
    "gen_shard",
    "micro_dp_group",
    "gather_group",
    "contains_training_shard",
)
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
        rows.append(
            dict(
                zip(
                    RANK_MAP_KEYS,
                    (
                        r,
                        c.pp,
                        c.tp,
                        c.dp,
                        train_shard(mesh, r),
                        g.dp,
                        g.pp,
                        g.tp,
                        gen_shard(mesh, r),
                        micro[r],
                        gather[r],
                        contains_training_shard(mesh, r),
                    ),
                )
            )
        )
    return rows
