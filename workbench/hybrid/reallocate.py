"""Runs a reallocation (`workbench.hybrid.realloc`'s transfer plan) on the ranks of one process
group: every source and destination rank calls `Reallocator.run` together.

One layer unit at a time (embedding, each decoder layer, head): a rank packs, for each peer it
sends to, the layer's fragments for that peer into one flat byte buffer, posts one send per peer
and one receive per peer it hears from in a single `torch.distributed.batch_isend_irecv` (NCCL
runs the batch as one grouped call; gloo posts them all before any waits, so the pairs never
deadlock), copies the fragments it keeps itself while those are in flight, then unpacks what
came into its destination pieces. Point-to-point, not broadcasts: each destination asks for its
own slices, which differ between destinations whenever the tensor-parallel sizes differ, and
broadcasts in subgroups would need a new communicator for every (sender, receivers) set the plan
uses; one message per peer pair per layer keeps the latency count at one batch per layer and the
bytes at exactly the plan's. No rank ever holds more than its source pieces, its destination
pieces and one layer's send and receive buffers (kept between layers and runs).

The group is any torch.distributed group holding every rank of the plan (plan ranks are group
ranks): the default world, a `new_group`, or a separate group between two pools' processes built
from a store (`open_group`, the weight channel's pattern). gloo on CPU, NCCL on CUDA (there a
group's first batched point-to-point call must involve all its ranks: where some take no part,
run any collective on the group first, e.g. a barrier). Checked here on gloo only.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from workbench.hybrid.channel import ChannelAddress, open_group
from workbench.hybrid.realloc import Fragment, Param, Placement, TransferPlan

__all__ = ["SPAN", "ChannelAddress", "ReallocStats", "Reallocator", "open_group", "piece_of"]


SPAN = "hybrid.realloc"
"""The trace span a worker records around a reallocation, with `ReallocStats.as_dict()` as its
extra fields (as `hybrid.transition` carries the hybrid engine's `TransitionStats`)."""


@dataclass
class ReallocStats:
    """What one reallocation cost on this rank."""

    seconds: float = 0.0
    bytes_sent: int = 0
    """Bytes of the messages this rank posted (its fragments for other ranks)."""
    bytes_received: int = 0
    bytes_copied: int = 0
    """Bytes of fragments it held itself (copied locally, nothing sent)."""
    layers: int = 0
    """Layer units it took part in (one batch of sends and receives each)."""
    messages: int = 0
    """Sends plus receives it posted."""

    def as_dict(self) -> dict:
        return asdict(self)


def piece_of(full: torch.Tensor, param: Param, placement: Placement, rank: int, n_units: int) -> torch.Tensor | None:
    """The piece of the whole weight `full` that group rank `rank` holds under `placement`
    (a copy; None when it holds nothing of it). For tests and benches that build layouts from
    a whole model; the reallocation itself never sees whole weights."""
    held = placement.holds(rank, param, placement.stage_map(n_units))
    if held is False:
        return None
    if held is None:
        return full.detach().clone()
    start, stop = held  # type: ignore[misc]
    return full.detach().narrow(param.dim, start, stop - start).clone()  # type: ignore[arg-type]


def _dtype(param: Param) -> torch.dtype:
    return getattr(torch, param.dtype)


@dataclass
class _Message:
    peer: int
    fragments: list[tuple[Fragment, int]]  # (fragment, byte offset in the message)
    nbytes: int
    offset: int = 0  # byte offset of the message in the layer's arena


class Reallocator:
    """This rank's part of `plan`, prepared once (peers, offsets, buffers) and run as often as
    the weights move. `group`: the process group (None: the default one); `device`: where the
    destination pieces and buffers live (the sources' device; "cuda" with NCCL)."""

    def __init__(self, plan: TransferPlan, group=None, device: torch.device | str = "cpu"):
        self.plan, self.group, self.device = plan, group, torch.device(device)
        size = group.size() if group is not None else dist.get_world_size()
        self.rank = group.rank() if group is not None else dist.get_rank()
        if plan.ranks[-1] >= size:
            raise ValueError(
                f"reallocation plan uses group rank {plan.ranks[-1]} but the group has {size} ranks: "
                "build the group over every source and destination rank (plan.ranks)"
            )
        try:
            self.registered = group is None or dist.get_process_group_ranks(group) is not None
        except (ValueError, KeyError, RuntimeError):
            self.registered = False
        self.params = {p.name: p for p in plan.params}
        self.n_units = len(plan.layers)
        self.layers = [self._prepare(fragments) for fragments in plan.layers]
        # The shapes of the pieces this rank reads from and writes to, checked once per run.
        self.source_shapes = self._shapes(plan.src, {f.name for f in plan.fragments if f.src == self.rank})
        self.dest_shapes = self._shapes(plan.dst, {f.name for f in plan.fragments if f.dst == self.rank})
        arena = max([0] + [m.offset + m.nbytes for sends, recvs, _, _ in self.layers for m in sends + recvs])
        self.send_arena = torch.empty(arena, dtype=torch.uint8, device=self.device)
        self.recv_arena = torch.empty(arena, dtype=torch.uint8, device=self.device)

    def _prepare(self, fragments: tuple[Fragment, ...]):
        """(messages to send, messages to receive, local fragments, destination params)."""
        sends: dict[int, _Message] = {}
        recvs: dict[int, _Message] = {}
        local = []
        for f in fragments:
            if f.src == self.rank and f.dst == self.rank:
                local.append(f)
            elif f.src == self.rank:
                _append(sends, f.dst, f, self.params[f.name])
            elif f.dst == self.rank:
                _append(recvs, f.src, f, self.params[f.name])
        for messages in (sends, recvs):
            offset = 0
            for m in messages.values():
                m.offset, offset = offset, _aligned(offset + m.nbytes, 8)
        names = list(dict.fromkeys(f.name for f in fragments if f.dst == self.rank))
        return list(sends.values()), list(recvs.values()), local, names

    @torch.no_grad()
    def run(
        self, source: Mapping[str, torch.Tensor] | None = None, out: dict[str, torch.Tensor] | None = None
    ) -> tuple[dict[str, torch.Tensor], ReallocStats]:
        """Move the weights. `source`: this rank's source pieces by name (what it holds in the
        source layout; None or empty on a rank that holds none); `out`: destination pieces to
        fill in place (missing ones are allocated). Returns this rank's destination pieces by
        name and what it cost. Every rank of the plan must call it (collective)."""
        source = source or {}
        out = {} if out is None else out
        self._check(source, out)
        stats, start = ReallocStats(), time.perf_counter()
        for sends, recvs, local, names in self.layers:
            if not (sends or recvs or local or names):
                continue
            stats.layers += 1
            for name in names:
                self._destination(name, out)
            for m in sends:
                self._pack(m, source)
                stats.bytes_sent += m.nbytes
            stats.bytes_received += sum(m.nbytes for m in recvs)
            works = self._post(
                [(m.peer, self.send_arena[m.offset : m.offset + m.nbytes]) for m in sends],
                [(m.peer, self.recv_arena[m.offset : m.offset + m.nbytes]) for m in recvs],
            )
            for f in local:  # while the messages are in flight
                self._view(out[f.name], f, f.dst_start).copy_(self._view(source[f.name], f, f.src_start))
                stats.bytes_copied += f.nbytes
            for w in works:
                w.wait()
            for m in recvs:
                for f, at in m.fragments:
                    dst = self._view(out[f.name], f, f.dst_start)
                    dst.copy_(self._arena_view(self.recv_arena, m.offset + at, f, dst.shape))
            stats.messages += len(works)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.seconds = time.perf_counter() - start
        return out, stats

    # ---- helpers -------------------------------------------------------------------------------
    def _post(self, sends: list, recvs: list) -> list:
        """Post every send and receive of a layer before waiting for any: one batch through
        torch.distributed (a group it knows), or straight on the backend of a group built from a
        store (`open_group`; torch.distributed's p2p API refuses groups it did not register)."""
        if not (sends or recvs):
            return []
        if self.registered:
            ops = [dist.P2POp(dist.isend, b, group=self.group, group_peer=p) for p, b in sends]
            ops += [dist.P2POp(dist.irecv, b, group=self.group, group_peer=p) for p, b in recvs]
            return dist.batch_isend_irecv(ops)
        works = [self.group.send([b], p, 0) for p, b in sends]
        return works + [self.group.recv([b], p, 0) for p, b in recvs]

    def _shapes(self, placement: Placement, names: set[str]) -> dict[str, tuple[int, ...]]:
        i = placement.index(self.rank)
        if i is None:
            return {}
        tp = placement.mesh.coord(i).tp
        return {n: self.params[n].piece_shape(tp, placement.mesh.tp) for n in sorted(names)}

    def _check(self, source: Mapping[str, torch.Tensor], out: dict[str, torch.Tensor]) -> None:
        """Before any message: every piece this rank sends from is there, in its shape, and every
        destination piece passed in `out` has its shape and dtype."""
        where = f"{self.plan.src.mesh} rank {self.plan.src.index(self.rank)}"
        for name, want in self.source_shapes.items():
            t = source.get(name)
            if t is None or tuple(t.shape) != want:
                got = "nothing" if t is None else f"a tensor of shape {tuple(t.shape)}"
                raise ValueError(
                    f"reallocation, rank {self.rank}: source[{name!r}] is {got}; this rank sends from its "
                    f"source piece of shape {want} ({where}): pass this rank's pieces by name"
                )
        for name, want in self.dest_shapes.items():
            have, dtype = out.get(name), _dtype(self.params[name])
            if have is not None and (tuple(have.shape) != want or have.dtype != dtype):
                raise ValueError(
                    f"reallocation, rank {self.rank}: out[{name!r}] is {tuple(have.shape)} {have.dtype}; "
                    f"its destination piece is {want} {dtype}"
                )

    def _destination(self, name: str, out: dict[str, torch.Tensor]) -> None:
        if name not in out:
            out[name] = torch.empty(self.dest_shapes[name], dtype=_dtype(self.params[name]), device=self.device)

    @staticmethod
    def _view(t: torch.Tensor, f: Fragment, start: int) -> torch.Tensor:
        return t if f.dim is None else t.narrow(f.dim, start, f.length)

    def _pack(self, m: _Message, source: Mapping[str, torch.Tensor]) -> None:
        for f, at in m.fragments:
            src = self._view(source[f.name], f, f.src_start)
            self._arena_view(self.send_arena, m.offset + at, f, src.shape).copy_(src)

    def _arena_view(self, arena: torch.Tensor, at: int, f: Fragment, shape) -> torch.Tensor:
        return arena[at : at + f.nbytes].view(_dtype(self.params[f.name])).view(shape)


def _aligned(n: int, to: int) -> int:
    return -(-n // to) * to


def _append(messages: dict[int, _Message], peer: int, f: Fragment, param: Param) -> None:
    m = messages.setdefault(peer, _Message(peer, [], 0))
    at = _aligned(m.nbytes, param.itemsize)  # a typed view of the bytes needs its alignment
    m.fragments.append((f, at))
    m.nbytes = at + f.nbytes
