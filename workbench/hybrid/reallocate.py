"""Runs a reallocation (`workbench.transfers`'s transfer plan) on the ranks of one process
group: every source and destination rank calls `Reallocator.run` together.

One layer unit at a time (embedding, each decoder layer, head): a rank posts all of the layer's
sends and receives at once (one `torch.distributed.batch_isend_irecv`: NCCL runs the batch as
one grouped call, gloo posts them all before any waits, so pairs never deadlock), copies the
fragments it keeps itself while those are in flight, then waits. A fragment travels as a
message of its own straight from the source piece into the destination piece where its slice is
contiguous in both (cuts along dim 0 and whole weights); the fragments between a pair that are
strided on either end (slices of pieces cut along a later dim) go together in one message,
packed into a staging buffer on both ends. Point-to-point, not broadcasts: each destination
asks for its own slices, which differ between destinations whenever the tensor-parallel sizes
differ, and broadcasts in subgroups would need a communicator for every (sender, receivers) set
the plan uses. No rank holds more than its source pieces, its destination pieces and one
layer's staging buffers (kept between layers and runs).

The group is any torch.distributed group holding every rank of the plan (plan ranks are group
ranks): the default world, a `new_group`, or a separate group between two pools' processes built
from a store (`open_group`, the weight channel's pattern). gloo on CPU, NCCL on CUDA (there a
group's first batched point-to-point call must involve all its ranks: where some take no part,
run any collective on the group first, e.g. a barrier). gloo over CUDA pieces (a weight channel
between processes sharing a GPU, where NCCL refuses two ranks on one device) goes through host
memory: gloo's send and receive take CPU tensors only, so each message is copied to or from a
host buffer around its transfer (`through_host`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from workbench.hybrid.channel import ChannelAddress, open_group
from workbench.transfers import Fragment, Param, Placement, Reallocation

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
    """Bytes of fragments it held itself (copied locally, nothing sent; views under `alias` not counted)."""
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


@dataclass
class _Leg:
    """One message, seen from one end: a fragment contiguous on both ends, sent from and
    received into the pieces themselves, or every fragment between the pair that is strided on
    either end, packed into a staging buffer on both."""

    peer: int
    fragments: list[tuple[Fragment, int, tuple[int, ...]]]
    """(fragment, byte offset in the message, slice shape)."""
    staged_at: int | None
    """Byte offset of the packed message in the layer's arena (None: a direct fragment)."""
    nbytes: int


class Reallocator:
    """This rank's part of `plan`, prepared once (messages, staging offsets, buffers) and run as
    often as the weights move. `group`: the process group (None: the default one); `device`:
    where the destination pieces and buffers live (the sources' device; "cuda" with NCCL)."""

    def __init__(self, plan: Reallocation, group=None, device: torch.device | str = "cpu"):
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
        # The shapes of the pieces this rank reads from and writes to, checked once per run.
        self.source_shapes = self._shapes(plan.src, {f.name for f in plan.fragments if f.src == self.rank})
        self.dest_shapes = self._shapes(plan.dst, {f.name for f in plan.fragments if f.dst == self.rank})
        self.layers = [self._prepare(fragments) for fragments in plan.layers]
        self.unit_names = [[q.name for q in plan.params if q.layer == u] for u in range(len(plan.layers))]
        self.is_source = plan.src.index(self.rank) is not None
        arena = max([0] + [size for *_, size in self.layers])
        self.local = [f for _, _, local, _, _ in self.layers for f in local]
        self.viewable = {f: self._viewable(f) for f in self.local}
        self.arena = torch.empty(arena, dtype=torch.uint8, device=self.device)
        self.through_host = self.device.type == "cuda" and backend_of(group) == "gloo"
        """Whether messages are staged in host memory (gloo with CUDA pieces)."""

    def _prepare(self, fragments: tuple[Fragment, ...]):
        """(legs to send, legs to receive, local fragments, destination names, staging bytes)."""
        sends: list[_Leg] = []
        recvs: list[_Leg] = []
        packed: dict[tuple[bool, int], _Leg] = {}
        local = []
        for f in fragments:
            if f.src == self.rank and f.dst == self.rank:
                local.append(f)
                continue
            if self.rank not in (f.src, f.dst):
                continue
            sending, param = f.src == self.rank, self.params[f.name]
            # Both ends classify alike: pieces of one weight have one shape per layout.
            src_piece, dst_piece = (
                param.piece_shape(0, self.plan.src.mesh.tp),
                param.piece_shape(0, self.plan.dst.mesh.tp),
            )
            shape = list(src_piece)
            if f.dim is not None:
                shape[f.dim] = f.length
            peer = f.dst if sending else f.src
            if _contiguous_slice(src_piece, f) and _contiguous_slice(dst_piece, f):
                (sends if sending else recvs).append(_Leg(peer, [(f, 0, tuple(shape))], None, f.nbytes))
                continue
            leg = packed.setdefault((sending, peer), _Leg(peer, [], 0, 0))
            at = _aligned(leg.nbytes, param.itemsize)  # a typed view of the bytes needs its alignment
            leg.fragments.append((f, at, tuple(shape)))
            leg.nbytes = at + f.nbytes
        arena = 0
        for (sending, _), leg in packed.items():  # after a pair's direct messages, on both ends
            leg.staged_at, arena = arena, _aligned(arena + leg.nbytes, 8)
            (sends if sending else recvs).append(leg)
        names = list(dict.fromkeys(f.name for f in fragments if f.dst == self.rank))
        return sends, recvs, local, names, arena

    def _viewable(self, f: Fragment) -> bool:
        """Whether local fragment `f` is this rank's whole destination piece and a contiguous
        slice of its source piece (so the destination piece may be a view of the source)."""
        dest = self.dest_shapes[f.name]
        whole = f.dim is None or f.length == dest[f.dim]
        alone = sum(g.dst == self.rank and g.name == f.name for g in self.plan.layers[f.layer]) == 1
        return whole and alone and _contiguous_slice(self.source_shapes[f.name], f)

    def messages(self) -> list[tuple[dict[int, int], dict[int, int]]]:
        """Per layer unit: bytes this rank sends to each peer, and receives from each."""
        out = []
        for sends, recvs, *_ in self.layers:
            to: dict[int, int] = {}
            frm: dict[int, int] = {}
            for leg in sends:
                to[leg.peer] = to.get(leg.peer, 0) + leg.nbytes
            for leg in recvs:
                frm[leg.peer] = frm.get(leg.peer, 0) + leg.nbytes
            out.append((to, frm))
        return out

    @torch.no_grad()
    def run(
        self,
        source: Mapping[str, torch.Tensor] | Callable[[list[str]], Mapping[str, torch.Tensor]] | None = None,
        out: dict[str, torch.Tensor] | None = None,
        alias: bool = False,
        done: Callable[[list[str]], None] | None = None,
    ) -> tuple[dict[str, torch.Tensor], ReallocStats]:
        """Move the weights. `source`: this rank's source pieces by name (what it holds in the
        source layout; None or empty on a rank that holds none), or a function giving them one
        layer unit at a time: every source rank calls it with each unit's weight names, in plan
        order, before the unit's messages, whether or not it sends any of them (so a source
        gathered from shards, e.g. FSDP's, may run its collectives inside it; the pieces are
        dropped after the unit). `out`: destination pieces to
        fill in place (missing ones are allocated). `alias`: a destination piece not in `out`
        that is whole and contiguous inside this rank's source piece becomes a view of it, not a
        copy (it then changes when the source does: for weights given up after the move, or
        moved again after every update). `done`: called with a layer unit's destination names
        as soon as their pieces are filled (a caller giving up source pieces layer by layer keeps
        its peak at one layer's worth of both). Returns this rank's destination pieces by name
        and what it cost. Every rank of the plan must call it (collective)."""
        by_unit: Callable[[list[str]], Mapping[str, torch.Tensor]] | None = None
        held: Mapping[str, torch.Tensor] = {}
        if callable(source):
            by_unit = source
            if alias:
                raise ValueError("reallocation: alias=True needs the whole source up front, not a function of units")
        else:
            held = source or {}
        out = {} if out is None else out
        self._check(held, out, None if by_unit is None else [])
        stats, start = ReallocStats(), time.perf_counter()
        viewed = set()
        if alias:
            for f in self.local:
                if f.name not in out and self.viewable[f]:
                    out[f.name] = self._slice(held[f.name], f, f.src_start)
                    viewed.add(f)
        for unit, (sends, recvs, local, names, _) in enumerate(self.layers):
            if by_unit is not None and self.is_source:
                held = by_unit(self.unit_names[unit])
                self._check(held, {}, self.unit_names[unit])
            if not (sends or recvs or local or names):
                continue
            stats.layers += 1
            for name in names:
                if name not in out:
                    out[name] = torch.empty(self.dest_shapes[name], dtype=self._dtype(name), device=self.device)
            outgoing = []
            for leg in sends:
                if leg.staged_at is None:
                    f = leg.fragments[0][0]
                    piece = self._slice(held[f.name], f, f.src_start)
                else:
                    for f, at, shape in leg.fragments:
                        self._staging(leg, f, at, shape).copy_(self._slice(held[f.name], f, f.src_start))
                    piece = self.arena[leg.staged_at : leg.staged_at + leg.nbytes]
                outgoing.append((leg.peer, piece))
                stats.bytes_sent += piece.numel() * piece.element_size()
            incoming = []
            for leg in recvs:
                if leg.staged_at is None:
                    f = leg.fragments[0][0]
                    into = self._slice(out[f.name], f, f.dst_start)
                else:
                    into = self.arena[leg.staged_at : leg.staged_at + leg.nbytes]
                incoming.append((leg.peer, into))
                stats.bytes_received += into.numel() * into.element_size()
            works = self._post(outgoing, incoming)
            for f in local:  # while the messages are in flight
                if f in viewed:
                    continue
                self._slice(out[f.name], f, f.dst_start).copy_(self._slice(held[f.name], f, f.src_start))
                stats.bytes_copied += f.nbytes
            for w in works:
                w.wait()
            for leg in recvs:
                if leg.staged_at is not None:
                    for f, at, shape in leg.fragments:
                        self._slice(out[f.name], f, f.dst_start).copy_(self._staging(leg, f, at, shape))
            stats.messages += len(outgoing) + len(incoming)
            if done is not None and names:
                done(names)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.seconds = time.perf_counter() - start
        return out, stats

    # ---- helpers -------------------------------------------------------------------------------
    def _post(self, sends: list, recvs: list) -> list:
        """Post every send and receive of a layer before waiting for any; under `through_host`
        from host copies and into host buffers, which land in their device pieces on wait()."""
        if not (sends or recvs):
            return []
        if not self.through_host:
            return self._transfer(sends, recvs)
        host_sends = [(p, t.to("cpu")) for p, t in sends]  # a synchronous copy: ready to send
        host_recvs = [(p, torch.empty(t.shape, dtype=t.dtype)) for p, t in recvs]
        works = self._transfer(host_sends, host_recvs)
        landings = [(t, host) for (_, t), (_, host) in zip(recvs, host_recvs)]
        return [_HostLanding(works, landings, [t for _, t in host_sends])]

    def _transfer(self, sends: list, recvs: list) -> list:
        """One batch through torch.distributed (a group it knows), or straight on the backend of
        a group built from a store (`open_group`; torch.distributed's p2p API refuses groups it
        did not register). Messages between one pair go in plan order on both ends, which is how
        they match."""
        if self.registered:
            ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=p) for p, t in sends]
            ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=p) for p, t in recvs]
            return dist.batch_isend_irecv(ops)
        works = [self.group.send([t], p, 0) for p, t in sends]
        return works + [self.group.recv([t], p, 0) for p, t in recvs]

    def _dtype(self, name: str) -> torch.dtype:
        return getattr(torch, self.params[name].dtype)

    def _shapes(self, placement: Placement, names: set[str]) -> dict[str, tuple[int, ...]]:
        i = placement.index(self.rank)
        if i is None:
            return {}
        tp = placement.mesh.coord(i).tp
        return {n: self.params[n].piece_shape(tp, placement.mesh.tp) for n in sorted(names)}

    def _check(
        self, source: Mapping[str, torch.Tensor], out: dict[str, torch.Tensor], names: list[str] | None = None
    ) -> None:
        """Before any message: every piece this rank sends from is there (of `names`, when the
        source comes a layer unit at a time), in its shape, dense, and every destination piece
        passed in `out` has its shape and dtype and is dense."""
        where = f"{self.plan.src.mesh} rank {self.plan.src.index(self.rank)}"
        for name, want in self.source_shapes.items():
            if names is not None and name not in names:
                continue
            t = source.get(name)
            if t is None or tuple(t.shape) != want or not t.is_contiguous():
                got = "nothing" if t is None else f"a tensor of shape {tuple(t.shape)}"
                got += "" if t is None or t.is_contiguous() else " (not contiguous)"
                raise ValueError(
                    f"reallocation, rank {self.rank}: source[{name!r}] is {got}; this rank sends from its "
                    f"source piece of shape {want} ({where}): pass this rank's contiguous pieces by name"
                )
        for name, want in self.dest_shapes.items():
            have, dtype = out.get(name), self._dtype(name)
            if have is not None and (tuple(have.shape) != want or have.dtype != dtype or not have.is_contiguous()):
                raise ValueError(
                    f"reallocation, rank {self.rank}: out[{name!r}] is {tuple(have.shape)} {have.dtype}"
                    f"{'' if have.is_contiguous() else ' (not contiguous)'}; its destination piece is a "
                    f"contiguous {want} {dtype}"
                )

    @staticmethod
    def _slice(t: torch.Tensor, f: Fragment, start: int) -> torch.Tensor:
        return t if f.dim is None else t.narrow(f.dim, start, f.length)

    def _staging(self, leg: _Leg, f: Fragment, at: int, shape: tuple[int, ...]) -> torch.Tensor:
        assert leg.staged_at is not None
        start = leg.staged_at + at
        return self.arena[start : start + f.nbytes].view(self._dtype(f.name)).view(shape)


class _HostLanding:
    """A layer's messages staged in host memory, waited on as one: wait() waits for every
    transfer, then copies each received host buffer into its device piece."""

    def __init__(self, works: list, landings: list[tuple[torch.Tensor, torch.Tensor]], sent: list[torch.Tensor]):
        self.works, self.landings = works, landings
        self.sent = sent  # the host copies being sent: held until the sends are done

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        for device_piece, host in self.landings:
            device_piece.copy_(host)
        self.sent = []


def backend_of(group) -> str:
    """The backend's name of `group` (None: the default group), registered with
    torch.distributed or built from a store (`open_group`)."""
    if group is None:
        return str(dist.get_backend())
    try:
        return str(dist.get_backend(group))
    except (ValueError, RuntimeError):  # not in the world's map: a backend object of its own
        return group.name()


def _contiguous_slice(shape: tuple[int, ...], f: Fragment) -> bool:
    """Whether the fragment's slice of a dense piece of `shape` is dense itself: a whole weight,
    or a cut along a dim with only size-1 dims before it, or the whole extent of its dim."""
    if f.dim is None or f.length == shape[f.dim]:
        return True
    return all(n == 1 for n in shape[: f.dim])


def _aligned(n: int, to: int) -> int:
    return -(-n // to) * to
