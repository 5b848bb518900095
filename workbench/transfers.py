"""Parameter reallocation as data: which rank sends which slice of which weight when a model
moves from one (mesh, layout) to another (ReaLHF §4's parameter redistribution).

Pure functions, like `layouts`: the executor (`workbench.hybrid.reallocate`) moves exactly the
fragments planned here, and the planner's byte count (`rank_bytes`) is read from the same plan,
so the runtime and the simulator count the bytes once.

A model is a list of `Param`s: name, shape, the dim tensor parallelism cuts it along (None: whole
on every tensor-parallel rank, as norms are), and its *layer unit*: 0 the embedding, 1..L the
decoder layers, L+1 the final norm and the head (`llama_params` builds this for a Llama).
A `Placement` is a `Mesh` (pp, tp, dp; rank order as `workbench.mesh` says) on a list
of ranks of one process group (by default `first`, `first`+1, ...), with a layer unit -> pipeline
stage map (by default `even_stages`). The rank at (pp s, tp k, dp r) holds, of every unit of
stage s, tensor piece k of the cut weights (`layouts.slices`) and the whole of the others.

The plan: for every destination rank, parameter and source tensor piece its own piece overlaps,
one `Fragment` (a slice along the cut dim, or the whole weight) and the rank that sends it.
Every source data-parallel replica holds the slice; the sender is chosen by a fixed rule (so the
bytes per rank are a function of the layouts alone and the planner can count them per layer
class, not per layer):
1. the destination itself when it holds the slice (a local copy, no bytes);
2. else, when the destination is a source rank, the holder in its own source replica (the ranks
   of one replica are consecutive, so on the same machine where a replica fits one; for the
   3D-HybridEngine's "hybridflow" grouping this is its micro-DP all-gather, byte for byte);
3. else (a rank new to the model, e.g. another pool) holder number (destination index in its
   mesh) mod (holders): destinations spread over the replicas (and, for whole weights, over the
   tensor-parallel ranks), ReaLHF's "sources broadcast in parallel".
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from math import gcd, prod
from typing import NamedTuple

from workbench.layouts import generation_groups, slices
from workbench.mesh import Mesh

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "uint8": 1, "int8": 1}
"""Bytes per element of the dtypes a `Param` may name (torch's names without `torch.`)."""


@dataclass(frozen=True)
class Param:
    """One weight of the model, as a reallocation sees it."""

    name: str
    shape: tuple[int, ...]
    dim: int | None
    """The dim tensor parallelism cuts it along (in tp equal pieces); None: whole on every rank."""
    layer: int
    """Its layer unit: 0 the embedding, 1..L decoder layers, L+1 the final norm and head."""
    dtype: str = "float32"

    def __post_init__(self):
        if not isinstance(self.shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in self.shape):
            raise ValueError(f"Param {self.name!r}: shape {self.shape!r} must be a tuple of sizes >= 0")
        if self.dim is not None and not 0 <= self.dim < len(self.shape):
            raise ValueError(
                f"Param {self.name!r}: split dim {self.dim} outside its {len(self.shape)}-dim shape {self.shape}; "
                "give the dim tensor parallelism cuts, or None for a weight whole on every rank"
            )
        if not isinstance(self.layer, int) or self.layer < 0:
            raise ValueError(f"Param {self.name!r}: layer unit {self.layer!r} must be a whole number >= 0")
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"Param {self.name!r}: dtype {self.dtype!r} is not one of {sorted(ITEMSIZE)}")

    @property
    def numel(self) -> int:
        return prod(self.shape)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    def piece(self, tp_index: int, tp: int) -> tuple[int, int] | None:
        """[start, stop) along `dim` of tensor piece `tp_index` of `tp` (None: whole weight)."""
        if self.dim is None:
            return None
        try:
            return slices(self.shape[self.dim], tp_index, tp)
        except ValueError as e:
            raise ValueError(f"Param {self.name!r} (shape {self.shape}, cut along dim {self.dim}): {e}") from None

    def piece_shape(self, tp_index: int, tp: int) -> tuple[int, ...]:
        span = self.piece(tp_index, tp)
        if span is None:
            return self.shape
        shape = list(self.shape)
        shape[self.dim] = span[1] - span[0]  # type: ignore[index]
        return tuple(shape)


def even_stages(n_units: int, pp: int) -> tuple[int, ...]:
    """Stage of each of `n_units` layer units (embedding, L decoder layers, head): the decoder
    layers split into pp contiguous runs, the first L mod pp stages one layer longer; the
    embedding goes with the first stage, the head with the last."""
    layers = n_units - 2
    if layers < pp:
        raise ValueError(
            f"{layers} decoder layers do not fill pp={pp} pipeline stages: use pp <= {max(layers, 1)}, "
            "or give the stage of each layer unit (Placement.stages)"
        )
    base, extra = divmod(layers, pp)
    stages = [0]
    for s in range(pp):
        stages += [s] * (base + (s < extra))
    return (*stages, pp - 1)


@dataclass(frozen=True)
class Placement:
    """A layout on ranks: `mesh` (its pp, tp, dp; a generation layout on it is ignored) on
    `ranks` of the process group (mesh rank i is group rank ranks[i]; default `first` + i),
    layer unit u on stage `stages[u]` (default `even_stages`)."""

    mesh: Mesh
    first: int = 0
    ranks: tuple[int, ...] | None = None
    stages: tuple[int, ...] | None = None

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"Placement.mesh: expected a workbench Mesh, got {type(self.mesh).__name__}")
        object.__setattr__(self, "mesh", Mesh(self.mesh.pp, self.mesh.tp, self.mesh.dp))
        n = self.mesh.world_size
        ranks = tuple(range(self.first, self.first + n)) if self.ranks is None else tuple(self.ranks)
        if len(ranks) != n or len(set(ranks)) != n or min(ranks) < 0:
            raise ValueError(
                f"Placement of {self.mesh}: ranks {ranks} must be {n} distinct group ranks >= 0, one per mesh rank"
            )
        object.__setattr__(self, "ranks", ranks)
        if self.stages is not None:
            stages = tuple(self.stages)
            if any(not 0 <= s < self.mesh.pp for s in stages) or set(stages) != set(range(self.mesh.pp)):
                raise ValueError(
                    f"Placement of {self.mesh}: stages {stages} must name every stage 0..{self.mesh.pp - 1}"
                )
            if list(stages) != sorted(stages):
                raise ValueError(f"Placement of {self.mesh}: stages {stages} must be contiguous (non-decreasing)")
            object.__setattr__(self, "stages", stages)

    def stage_map(self, n_units: int) -> tuple[int, ...]:
        if self.stages is None:
            return even_stages(n_units, self.mesh.pp) if self.mesh.pp > 1 else (0,) * n_units
        if len(self.stages) != n_units:
            raise ValueError(
                f"Placement of {self.mesh}: {len(self.stages)} stages given for a model of {n_units} layer units"
            )
        return self.stages

    def index(self, rank: int) -> int | None:
        """Mesh rank of group rank `rank` (None: not in this placement)."""
        assert self.ranks is not None
        return self.ranks.index(rank) if rank in self.ranks else None

    def holds(self, rank: int, param: Param, stages: Sequence[int]) -> tuple[int, int] | None | bool:
        """What `rank` holds of `param`: its [start, stop) along the cut dim, None for the whole
        weight, False for nothing."""
        i = self.index(rank)
        if i is None:
            return False
        c = self.mesh.coord(i)
        if stages[param.layer] != c.pp:
            return False
        return param.piece(c.tp, self.mesh.tp)


class Fragment(NamedTuple):
    """One slice of one weight from one rank to another (src == dst: a local copy)."""

    name: str
    layer: int
    src: int
    dst: int
    dim: int | None
    """The cut dim the slice runs along; None: the whole weight."""
    src_start: int
    """Where the slice starts along `dim` in the sender's piece."""
    dst_start: int
    """Where it goes along `dim` in the receiver's piece."""
    length: int
    """Its extent along `dim`."""
    nbytes: int


class RankBytes(NamedTuple):
    """Bytes one rank sends and receives in a reallocation (local copies not counted)."""

    sent: int
    received: int


@dataclass(frozen=True)
class Reallocation:
    """Every fragment of a reallocation, by layer unit (`layers[u]` in sending order)."""

    src: Placement
    dst: Placement
    params: tuple[Param, ...]
    layers: tuple[tuple[Fragment, ...], ...] = field(repr=False)

    @property
    def fragments(self) -> list[Fragment]:
        return [f for layer in self.layers for f in layer]

    @property
    def ranks(self) -> list[int]:
        """Every group rank in the reallocation (sources and destinations), sorted."""
        assert self.src.ranks is not None and self.dst.ranks is not None
        return sorted(set(self.src.ranks) | set(self.dst.ranks))

    def bytes_per_rank(self) -> dict[int, RankBytes]:
        """Bytes each rank of `ranks` sends and receives, summed over the fragments."""
        sent: Counter[int] = Counter()
        received: Counter[int] = Counter()
        for f in self.fragments:
            if f.src != f.dst:
                sent[f.src] += f.nbytes
                received[f.dst] += f.nbytes
        return {r: RankBytes(sent[r], received[r]) for r in self.ranks}


def _unit_count(params: Sequence[Param]) -> int:
    if not params:
        raise ValueError("a reallocation needs at least one Param")
    names = Counter(p.name for p in params)
    twice = [n for n, k in names.items() if k > 1]
    if twice:
        raise ValueError(f"parameter names must be unique; repeated: {twice[:3]}")
    return max(p.layer for p in params) + 1


def _param_fragments(param: Param, src: Placement, s_src: int, dst: Placement, s_dst: int) -> list[Fragment]:
    """The fragments of one weight: for each destination rank of stage `s_dst`, its piece's
    overlap with each source piece of stage `s_src`, from the sender the module's rule picks."""
    m1, m2 = src.mesh, dst.mesh
    assert src.ranks is not None and dst.ranks is not None
    src_index = {r: i for i, r in enumerate(src.ranks)}
    out = []
    for j, d in enumerate(dst.ranks):
        c2 = m2.coord(j)
        if c2.pp != s_dst:
            continue
        want = param.piece(c2.tp, m2.tp)
        if want is None:  # whole weight: every rank of the source stage holds it
            holders = [src.ranks[m1.rank(s_src, k, r)] for r in range(m1.dp) for k in range(m1.tp)]
            sender = _sender(d, j, holders, src, src_index)
            out.append(Fragment(param.name, param.layer, sender, d, None, 0, 0, 0, param.numel * param.itemsize))
            continue
        for k in range(m1.tp):
            have = param.piece(k, m1.tp)
            assert have is not None
            lo, hi = max(want[0], have[0]), min(want[1], have[1])
            if lo >= hi:
                continue
            holders = [src.ranks[m1.rank(s_src, k, r)] for r in range(m1.dp)]
            sender = _sender(d, j, holders, src, src_index)
            nbytes = param.numel // param.shape[param.dim] * (hi - lo) * param.itemsize  # type: ignore[index]
            out.append(
                Fragment(param.name, param.layer, sender, d, param.dim, lo - have[0], lo - want[0], hi - lo, nbytes)
            )
    return out


def _sender(d: int, j: int, holders: list[int], src: Placement, src_index: dict[int, int]) -> int:
    """The module docstring's rule: itself, else a holder in its own source replica (its own
    tensor position first), else holder j mod len(holders)."""
    if d in holders:
        return d
    if d in src_index:
        own = src.mesh.coord(src_index[d])
        mine = [h for h in holders if src.mesh.coord(src_index[h]).dp == own.dp]
        same_tp = [h for h in mine if src.mesh.coord(src_index[h]).tp == own.tp]
        return (same_tp or mine)[0]
    return holders[j % len(holders)]


def plan(params: Iterable[Param], src: Placement, dst: Placement) -> Reallocation:
    """The transfer plan moving `params` from `src` to `dst` (same, overlapping or disjoint ranks)."""
    params = tuple(params)
    n_units = _unit_count(params)
    st_src, st_dst = src.stage_map(n_units), dst.stage_map(n_units)
    layers: list[list[Fragment]] = [[] for _ in range(n_units)]
    for p in params:
        layers[p.layer] += _param_fragments(p, src, st_src[p.layer], dst, st_dst[p.layer])
    return Reallocation(src, dst, params, tuple(tuple(f) for f in layers))


def rank_bytes(params: Iterable[Param], src: Placement, dst: Placement) -> dict[int, RankBytes]:
    """Bytes each rank sends and receives, equal to `plan(...).bytes_per_rank()` but cheap enough
    for the planner's search on models of hundreds of layers: the senders and the share of a
    weight each fragment carries depend only on the two stages and on whether the weight is cut
    (a cut dim splits into the same fractions whatever its size), so one stand-in weight is
    planned per (source stage, destination stage, cut or whole) and its fragments' shares are
    applied to the bytes of the weights it stands for."""
    params = tuple(params)
    n_units = _unit_count(params)
    st_src, st_dst = src.stage_map(n_units), dst.stage_map(n_units)
    t1, t2 = src.mesh.tp, dst.mesh.tp
    unit = t1 * t2 // gcd(t1, t2)  # every cut dim divides into t1 and t2 pieces, so into lcm(t1, t2)
    weights: Counter[tuple[int, int, bool]] = Counter()
    for p in params:
        if p.dim is not None:
            p.piece(0, t1), p.piece(0, t2)  # the clear error plan() gives for a dim that does not split
        weights[st_src[p.layer], st_dst[p.layer], p.dim is not None] += p.numel * p.itemsize
    sent: Counter[int] = Counter()
    received: Counter[int] = Counter()
    for (s1, s2, cut), nbytes in weights.items():
        stand_in = Param("stand-in", (unit,), 0 if cut else None, 0, "uint8")
        for f in _param_fragments(stand_in, src, s1, dst, s2):
            if f.src != f.dst:
                moved = nbytes * f.length // unit if cut else nbytes
                sent[f.src] += moved
                received[f.dst] += moved
    ranks = sorted(set(src.ranks or ()) | set(dst.ranks or ()))
    return {r: RankBytes(sent[r], received[r]) for r in ranks}


# ---- Llama-shaped models (the tiny kit's, the planner's ModelSpec) ---------------------------
COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")


def llama_split(name: str, ndim: int) -> int | None:
    """The dim `workbench.engines.tensor_parallel.llama_tp_plan` cuts a Llama weight along:
    column-parallel projections by output features (0), row-parallel ones by input features (1),
    the embedding and the head (lm_head / score) by the hidden dim (1); norms stay whole."""
    if ndim == 2:
        if any(name.endswith(f"{c}.weight") for c in COLUMN):
            return 0
        if any(name.endswith(f"{r}.weight") for r in ROW):
            return 1
        if name in ("model.embed_tokens.weight", "lm_head.weight", "score.weight"):
            return 1
    return None


def llama_layer(name: str, n_layers: int) -> int:
    """Layer unit of a Llama weight: 0 the embedding, 1 + i `model.layers.i.*`, L+1 the rest
    (under any prefix a wrapper adds, e.g. LoRA's `base_model.model.`)."""
    layer = _LAYER.search(name)
    if layer is not None:
        return 1 + int(layer.group(1))
    return 0 if "embed_tokens." in name else n_layers + 1


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_count(names: Iterable[str]) -> int:
    """How many decoder layers the weights `names` have (`llama_layer`'s L)."""
    return len({int(m.group(1)) for n in names if (m := _LAYER.search(n)) is not None})


def llama_params(shapes: dict[str, tuple[int, ...]], n_layers: int, dtype: str = "float32") -> list[Param]:
    """`Param`s of a Llama-style model from its {name: shape} (e.g. a state dict's shapes)."""
    return [Param(n, tuple(s), llama_split(n, len(s)), llama_layer(n, n_layers), dtype) for n, s in shapes.items()]


def llama_shapes(
    hidden: int, n_layers: int, n_heads: int, n_kv_heads: int, intermediate: int, vocab: int, value_head: bool = False
) -> dict[str, tuple[int, ...]]:
    """{name: shape} of an HF Llama causal LM (untied head) or value model (`score` head)."""
    kv = n_kv_heads * (hidden // n_heads)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (intermediate, hidden),
            p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    shapes["score.weight" if value_head else "lm_head.weight"] = (1, hidden) if value_head else (vocab, hidden)
    return shapes


def hybrid_engine_placements(mesh: Mesh) -> tuple[Placement, Placement]:
    """The 3D-HybridEngine's switch as a reallocation on the same ranks: the training layout
    (pp, tp, dp) and the generation layout (gen_pp, gen_tp, dp·micro_dp) on the ranks of
    `layouts.generation_groups` (replica-major, stage, tensor innermost: the Mesh rank order),
    which place generation groups as `mesh.transition` says."""
    gen_pp, gen_tp = mesh.gen_pp or mesh.pp, mesh.gen_tp or mesh.tp
    gen = Mesh(gen_pp, gen_tp, mesh.dp * mesh.micro_dp)
    ranks = tuple(r for group in generation_groups(mesh) for r in group)
    return Placement(Mesh(mesh.pp, mesh.tp, mesh.dp)), Placement(gen, ranks=ranks)


def switch_placements(mesh: Mesh) -> tuple[Placement, Placement]:
    """The 3D-HybridEngine's switch under `mesh.transition` as a reallocation: the training
    layout and the layout each rank holds at the switch's peak (`layouts.gathered_shard`),
    the generation piece being a view inside it.

    - hybridflow: the generation layout itself (`hybrid_engine_placements`: strided groups, so
      each rank's generation piece contains its training piece);
    - vanilla: the whole model on every rank (its TP·PP group rebuilds it), or the training
      layout when the generation layout is the training one (nothing moves);
    - deepspeed_chat: the whole model on every rank.

    Planned from the training layout's pieces, the bytes are Table 2's
    (`layouts.transition_bytes`) for hybridflow and vanilla. deepspeed_chat's all-gather starts
    from ZeRO-3 partitions (each data-parallel copy holds 1/d of its tensor piece) that a
    `Placement` does not describe: from whole tensor pieces each rank receives the rest of the
    model from its own replica, (d-1)/d · M/(p·t) less than Table 2 counts (and sends as much
    less), the part of its own piece ZeRO-3 made it fetch from its d-1 twins."""
    src, gen = hybrid_engine_placements(mesh)
    if mesh.transition == "hybridflow":
        return src, gen
    if mesh.transition == "vanilla" and mesh.micro_dp == 1:
        return src, src
    return src, Placement(Mesh(1, 1, mesh.world_size))


def switch_plan(params: Iterable[Param], mesh: Mesh) -> Reallocation:
    """The hybrid engine's switch under `mesh` as the reallocation it runs: the cut weights
    only (whole ones, the norms, are shared by both models and never move)."""
    return plan(_cut(params), *switch_placements(mesh))


def switch_bytes(params: Iterable[Param], mesh: Mesh) -> dict[int, RankBytes]:
    """Bytes each rank sends and receives in `switch_plan(params, mesh)` (what the hybrid
    engine's reallocation counts), by `rank_bytes`: cheap enough for the planner, which prices
    the switch with it."""
    return rank_bytes(_cut(params), *switch_placements(mesh))


def _cut(params: Iterable[Param]) -> list[Param]:
    return [p for p in params if p.dim is not None]


def describe(plan_: Reallocation) -> str:
    """A short table: per rank, MiB sent and received and its peers."""
    peers: defaultdict[int, set[int]] = defaultdict(set)
    for f in plan_.fragments:
        if f.src != f.dst:
            peers[f.src].add(f.dst)
    lines = [f"{plan_.src.mesh.short()} on {plan_.src.ranks} -> {plan_.dst.mesh.short()} on {plan_.dst.ranks}"]
    for r, b in plan_.bytes_per_rank().items():
        lines.append(
            f"  rank {r}: sends {b.sent / 2**20:.3f} MiB to {sorted(peers[r])}, receives {b.received / 2**20:.3f} MiB"
        )
    return "\n".join(lines)
