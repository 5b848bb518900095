"""The 3D-HybridEngine's switch between the training layout and the generation layout of the
actor's weights (HybridFlow §3 / Table 2), on the ranks that hold them.

Training: every projection cut into t pieces over a tensor-parallel group (engines.tensor_parallel).
Generation: cut into t_g <= t pieces over the generation groups of `mesh.transition`'s method.
`to_generation()` fills the generation model's pieces with all-gathers, one per decoder layer:
- "hybridflow": inside each micro-DP group (t/t_g consecutive ranks). The gathered piece contains
  this rank's training piece, so the training parameter is re-pointed into it: nothing is kept
  twice and peak parameter memory is the generation shard, M/t_g.
- "vanilla": inside the training TP group; the whole tensor is rebuilt and kept (peak M), the
  generation piece is a view of it and the training piece stays beside it (redundant M/t).
- "deepspeed_chat": over all ranks, each contributing 1/d of its training piece (the d replicas
  split the copies they share, as ZeRO-3 does), the whole model rebuilt on every rank (peak M);
  each rank keeps its 1/d partition beside it (redundant M/(t·d)).
`to_training()` drops the generation buffers (hybridflow first copies each training piece out).
With pipeline stages (gen_pp = pp, hybridflow) the models are one stage's, and each stage
switches inside its own tensor-parallel group, by the all-gathers.

By default (`executor="reallocate"`) the weights move as a parameter reallocation instead of by
those all-gathers: batched point-to-point (`workbench.hybrid.reallocate`), one decoder layer at a
time, from the training layout to the block each rank gathers (`transfers.switch_placements`), the
generation pieces and what each method keeps coming out bit-identical. hybridflow's training
piece is copied once into its generation piece and re-pointed there layer by layer (zero
redundancy, peak M/t_g as before); vanilla moves Table 2's bytes; deepspeed_chat
(d-1)/d·M/(p·t) fewer than its ZeRO-3 all-gather, since every rank already holds its whole
tensor piece. It took 0.57-0.72x the all-gathers' time on CPU/gloo for all three methods
(bench/results/transition/run5_realloc). `executor="allgather"` keeps the collectives above.

Weights that are whole on every rank (norms) are shared by both models and never moved; the
counted bytes and memory cover the tensor-parallel weights, the M of Table 2.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from workbench import layouts
from workbench.engines.tensor_parallel import local, shard_dim
from workbench.errors import WeightSyncError
from workbench.hybrid.reallocate import Reallocator
from workbench.mesh import Mesh
from workbench.transfers import Param, llama_layer, switch_plan

# torch >= 2.13 names the one-tensor all-gather all_gather_single (all_gather_into_tensor before).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

EXECUTORS = ("reallocate", "allgather")
"""How `HybridEngine.to_generation` moves the weights: the switch as a reallocation by
point-to-point (the default), or all-gathers in each method's gather groups (Table 2's
collectives)."""


@dataclass
class TransitionStats:
    """What one switch to the generation layout cost on this rank."""

    method: str
    seconds: float = 0.0
    """The switch itself: all-gathers and re-pointing."""
    executor: str = "reallocate"
    """How the weights moved (`EXECUTORS`)."""
    bytes_sent: int = 0
    """Bytes this rank sent in its all-gathers (ring: its piece to each other member), or in its
    reallocation messages."""
    bytes_received: int = 0
    """Bytes this rank received (every other member's piece, or its reallocation fragments)."""
    model_bytes: int = 0
    """M: the tensor-parallel weights of the whole model."""
    peak_param_bytes: int = 0
    """Tensor-parallel weight bytes of the gathered generation buffers (Table 2's peak parameter
    memory: the whole model for vanilla and deepspeed_chat, M/t_g for hybridflow)."""
    redundant_bytes: int = 0
    """Training bytes kept beside (not inside) the generation buffers while generating."""
    checked: bool = False
    """Whether the weight-sync checksum ran (and passed)."""
    check_seconds: float = 0.0
    """Seconds of that check (not in `seconds`)."""

    def as_dict(self) -> dict:
        return asdict(self)


class HybridEngine:
    """Switches `train_model`'s weights (cut over the training TP group) into `gen_model` (the
    same architecture cut over the generation groups of `mesh`), and back."""

    def __init__(
        self,
        train_model: torch.nn.Module,
        gen_model: torch.nn.Module,
        mesh: Mesh,
        rank: int,
        tp_group=None,
        gen_tp_group=None,
        check: bool = True,
        executor: str = "reallocate",
    ):
        if mesh.pp != 1 and (mesh.transition != "hybridflow" or (mesh.gen_pp or mesh.pp) != mesh.pp):
            raise NotImplementedError(
                f"HybridEngine: with pipeline stages (mesh {mesh}) each stage switches inside its own "
                "tensor-parallel group: gen_pp=pp and transition='hybridflow'"
            )
        self.mesh, self.rank, self.check = mesh, rank, check
        # A reallocation plans a whole model's layer units; a stage's switch (train_model and
        # gen_model hold one stage) stays inside its tensor-parallel group: the all-gathers.
        self.executor = executor if mesh.pp == 1 else "allgather"
        self._checked_executor()
        self._reallocator: Reallocator | None = None  # planned at its first use
        # The generation piece holds the training piece: hybridflow, or vanilla with nothing to
        # change (the generation layout is the training layout).
        self.aliases = mesh.transition == "hybridflow" or (
            mesh.transition == "vanilla" and (mesh.gen_tp or mesh.tp) == mesh.tp
        )
        self.tp_group, self.gen_tp_group = tp_group, gen_tp_group
        self.pairs = self._pair(train_model, gen_model)
        # Every rank forms every gather group, in the same order (new_group is collective).
        self.gather_group, self.gather_members = None, (rank,)
        for members in layouts.gather_groups(mesh):
            group = dist.new_group(list(members)) if len(members) > 1 else None
            if rank in members:
                self.gather_group, self.gather_members = group, tuple(members)
        self.held: list[torch.Tensor] = []  # whole tensors vanilla / deepspeed_chat keep while generating
        self.kept: list[torch.Tensor] = []  # deepspeed_chat's own partitions, kept beside them
        self.in_generation = False
        self.buckets = self._buckets()
        self.release_generation_weights()

    @staticmethod
    def _pair(train_model, gen_model):
        gen = dict(gen_model.named_parameters())
        pairs = []
        for name, param in train_model.named_parameters():
            if name not in gen:
                raise KeyError(f"generation model has no parameter {name!r}")
            pairs.append((name, param, gen[name]))
        return pairs

    @torch.no_grad()
    def release_generation_weights(self) -> None:
        """Free the generation pieces (whole weights stay shared with the training model)."""
        for _, train, gen in self.pairs:
            if shard_dim(train) is None:
                local(gen).data = local(train)  # same tensor: always in sync
            else:
                local(gen).data = torch.empty(0, dtype=local(train).dtype, device=local(train).device)
        self.held, self.kept = [], []

    # ---- training -> generation --------------------------------------------------------------
    @torch.no_grad()
    def to_generation(self) -> TransitionStats:
        self.to_training()  # after a failed generation the last switch may still be in place
        start = time.time()
        stats = TransitionStats(method=self.mesh.transition, executor=self._checked_executor())
        if self.executor == "reallocate":
            self._reallocate(stats)
        else:
            for bucket in self.buckets:
                self._switch(bucket, stats)
        stats.peak_param_bytes, stats.redundant_bytes = self._resident_bytes()
        self.in_generation = True
        stats.seconds = time.time() - start
        if self.check:
            self.verify()
            stats.checked = True
            stats.check_seconds = time.time() - start - stats.seconds
        return stats

    def _buckets(self) -> list[list[tuple]]:
        """The cut weights in groups that share one all-gather: a decoder layer's weights
        together (many small collectives cost more than one of the same bytes), every other
        weight alone; each weight alone when there is nothing to gather."""
        buckets: dict[str, list[tuple]] = {}
        for name, train, gen in self.pairs:
            dim = shard_dim(train)
            if dim is None:
                continue
            layer = name.split(".")[:3] if name.startswith("model.layers.") and len(self.gather_members) > 1 else [name]
            buckets.setdefault(".".join(layer), []).append((name, train, gen, dim))
        return list(buckets.values())

    def _switch(self, bucket: list[tuple], stats: TransitionStats) -> None:
        """One all-gather for the bucket's contributions, then each weight's generation piece."""
        size = len(self.gather_members)
        parts = [self._contribution(local(train)) for _, train, _, _ in bucket]
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        gathered = self._all_gather(flat).view(size, -1)
        offset = 0
        for (_name, train, gen, dim), part in zip(bucket, parts):
            piece = local(train)
            column = gathered[:, offset : offset + part.numel()]  # every member's part of this weight
            offset += part.numel()
            if self.mesh.transition == "deepspeed_chat":  # ranks are (dp, tp): regroup to (tp, dp)
                pieces = (
                    column.reshape(self.mesh.dp, self.mesh.tp, -1).transpose(0, 1).reshape(self.mesh.tp, *piece.shape)
                )
            else:
                pieces = column.reshape(size, *piece.shape)
            whole = pieces.reshape(-1, *piece.shape[1:]) if dim == 0 else torch.cat(pieces.unbind(0), dim=dim)
            nbytes = part.numel() * part.element_size()
            stats.model_bytes += piece.numel() * piece.element_size() * self.mesh.tp
            stats.bytes_sent += nbytes * (size - 1)  # ring: its part, then the size-2 it relays
            stats.bytes_received += nbytes * (size - 1)
            local(gen).data = self._generation_piece(whole, piece, dim)

    def _checked_executor(self) -> str:
        if self.executor not in EXECUTORS:
            raise ValueError(f"HybridEngine: executor {self.executor!r}; use one of {', '.join(EXECUTORS)}")
        return self.executor

    def _reallocate(self, stats: TransitionStats) -> None:
        """The switch as a reallocation: each layer's generation pieces filled by point-to-point,
        then finished as the all-gather path finishes them (`_generation_piece`) before the next
        layer, so the training pieces hybridflow re-points are given up layer by layer."""
        cut = {name: (train, gen, dim) for name, train, gen in self.pairs if (dim := shard_dim(train)) is not None}
        if self._reallocator is None:
            self._reallocator = self._plan_reallocation(cut)
        out: dict[str, torch.Tensor] = {}

        def finish(names: list[str]) -> None:
            for name in names:
                train, gen, dim = cut[name]
                local(gen).data = self._generation_piece(out.pop(name), local(train), dim)

        source = {name: local(train) for name, (train, _, _) in cut.items()}
        _, moved = self._reallocator.run(source, out=out, alias=True, done=finish)
        stats.bytes_sent, stats.bytes_received = moved.bytes_sent, moved.bytes_received
        stats.model_bytes = sum(local(t).numel() * local(t).element_size() * self.mesh.tp for t, _, _ in cut.values())

    def _plan_reallocation(self, cut: dict) -> Reallocator:
        """This rank's part of the switch planned as a reallocation over the default group (its
        ranks are the mesh's, as the gather groups assume)."""
        n_layers = len({name.split(".")[2] for name in cut if name.startswith("model.layers.")})
        params = [
            Param(name, tuple(train.shape), dim, llama_layer(name, n_layers), str(local(train).dtype)[len("torch.") :])
            for name, (train, _, dim) in cut.items()
        ]
        device = local(next(iter(cut.values()))[0]).device if cut else "cpu"
        reallocator = Reallocator(switch_plan(params, self.mesh), device=device)
        if reallocator.rank != self.rank:
            raise ValueError(
                f"HybridEngine (executor='reallocate'): rank {self.rank} is rank {reallocator.rank} of the default "
                "process group; the reallocation needs the mesh's ranks to be the group's"
            )
        return reallocator

    def _contribution(self, piece: torch.Tensor) -> torch.Tensor:
        """What this rank sends of a training piece: all of it, or for deepspeed_chat its 1/d
        (the d replicas split the piece they share, as ZeRO-3 partitions it)."""
        if self.mesh.transition != "deepspeed_chat":
            return piece.reshape(-1)
        d = self.mesh.dp
        if piece.numel() % d:
            raise ValueError(
                f"deepspeed_chat transition: a piece of {piece.numel()} elements does not split over dp={d}"
            )
        return piece.reshape(-1).chunk(d)[self.mesh.coord(self.rank).dp]

    def _all_gather(self, flat: torch.Tensor) -> torch.Tensor:
        if len(self.gather_members) == 1:
            return flat
        out = torch.empty(len(self.gather_members) * flat.numel(), dtype=flat.dtype, device=flat.device)
        _all_gather_single(out, flat.contiguous(), group=self.gather_group)
        return out

    def _generation_piece(self, gathered: torch.Tensor, piece: torch.Tensor, dim: int) -> torch.Tensor:
        gen_tp = self.mesh.gen_tp or self.mesh.tp
        if self.aliases:
            # `gathered` is this rank's generation piece and holds its training piece at its
            # position in the micro-DP group: point the training parameter there.
            at = self.gather_members.index(self.rank)
            piece.data = gathered.narrow(dim, at * piece.shape[dim], piece.shape[dim])
            return gathered
        self.held.append(gathered)
        if self.mesh.transition == "deepspeed_chat":
            # Like ZeRO-3 under DeepSpeed-Chat: the rank keeps only its own partition (1/d of its
            # training piece) beside the gathered model; the piece itself is read back from it.
            d, tp_width = self.mesh.dp, piece.shape[dim]
            self.kept.append(piece.reshape(-1).chunk(d)[self.mesh.coord(self.rank).dp].clone())
            piece.data = gathered.narrow(dim, self.mesh.coord(self.rank).tp * tp_width, tp_width)
        width = gathered.shape[dim] // gen_tp
        return gathered.narrow(dim, self.mesh.gen_coord(self.rank).tp * width, width)

    def _resident_bytes(self) -> tuple[int, int]:
        """(bytes of the generation buffers, training bytes held outside them)."""
        gen_storages, total = set(), 0
        for _, train, gen in self.pairs:
            if shard_dim(train) is None:
                continue
            storage = local(gen).untyped_storage()
            if storage.data_ptr() not in gen_storages:
                gen_storages.add(storage.data_ptr())
                total += storage.nbytes()
        redundant = sum(t.numel() * t.element_size() for t in self.kept)
        for _, train, _ in self.pairs:
            if shard_dim(train) is None:
                continue
            storage = local(train).untyped_storage()
            if storage.data_ptr() not in gen_storages:
                redundant += storage.nbytes()
        return total, redundant

    # ---- generation -> training --------------------------------------------------------------
    @torch.no_grad()
    def to_training(self) -> None:
        if not self.in_generation:
            return
        for _, train, _ in self.pairs:
            if shard_dim(train) is not None and (self.aliases or self.mesh.transition == "deepspeed_chat"):
                local(train).data = local(train).data.clone()  # own storage again, contiguous
        self.release_generation_weights()
        self.in_generation = False

    # ---- the weight-sync checker ---------------------------------------------------------------
    @torch.no_grad()
    def verify(self) -> None:
        """A position-weighted checksum of every tensor-parallel weight, summed over the training
        pieces and over the generation pieces: equal when the generation weights are the training
        weights, each in its place. Raises WeightSyncError naming the first tensor that differs."""
        names, train_sums, gen_sums = [], [], []
        tp_index, gen_index = self.mesh.coord(self.rank).tp, self.mesh.gen_coord(self.rank).tp
        for name, train, gen in self.pairs:
            dim = shard_dim(train)
            if dim is None:
                continue
            names.append(name)
            train_sums.append(_checksum(local(train), dim, tp_index))
            gen_sums.append(_checksum(local(gen), dim, gen_index))
        if not names:
            return
        train_total = torch.stack(train_sums)
        gen_total = torch.stack(gen_sums)
        if self.tp_group is not None:
            dist.all_reduce(train_total, group=self.tp_group)
        if self.gen_tp_group is not None:
            dist.all_reduce(gen_total, group=self.gen_tp_group)
        bad = ((train_total - gen_total).abs() > 1e-9 * train_total.abs().clamp(min=1.0)).nonzero()
        if len(bad):
            i = int(bad[0])
            train_total, gen_total = train_total.cpu(), gen_total.cpu()
            raise WeightSyncError(names[i], self.rank, float(train_total[i]), float(gen_total[i]))


def _checksum(piece: torch.Tensor, dim: int, index: int) -> torch.Tensor:
    """Of the piece `index` cut along `dim` of a 2-D weight: its row sums weighted by global row
    number plus its column sums weighted by global column number. Summed over the pieces of any
    cut it is the same number, and a value moved to another place changes it. Two reductions,
    no copy of the weight."""
    rows, cols = piece.sum(1, dtype=torch.float64), piece.sum(0, dtype=torch.float64)
    row0 = index * piece.shape[0] if dim == 0 else 0
    col0 = index * piece.shape[1] if dim == 1 else 0
    row_no = torch.arange(row0 + 1, row0 + 1 + len(rows), device=piece.device, dtype=torch.float64)
    col_no = torch.arange(col0 + 1, col0 + 1 + len(cols), device=piece.device, dtype=torch.float64)
    return (rows * row_no).sum() + 0.6180339887 * (cols * col_no).sum()
