"""A worker's membership of weight channels (workbench.hybrid.channel): the registered methods a
driver-side link (workbench.workers.rollout_link.WeightLink) calls to join a trained group with
every rank of a copy of the model elsewhere, and the loops that move the weights and record what
moved in the trace. Two ways to move them:
  * a broadcast: the trained group's rank 0 joins, gathers every weight from its peers and
    broadcasts it tensor by tensor (any backend; a rollout group's LoRA adapters);
  * a reallocation (workbench.hybrid.reallocate): every rank of the trained group joins and is a
    source; one layer unit at a time, each gathers the unit from its FSDP shards and sends whole
    weights (or, tensor parallel, sends from its own pieces) point to point to its share of the
    copy's ranks, so n sources send in parallel and the bytes each rank moved are counted in the
    trace. Each copy rank loads a unit as it arrives: into its FSDP shards (a critic's replica)
    or its rollout engine (AlgoConfig.rollout_weights="reallocate"), or has its tensor-parallel
    pieces filled in place.

Mixed into the workers whose weights travel between pools: the actor (to a rollout group) and
the critic (to a replica that computes values on other devices, a per-call plan's)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import psutil
import ray
import torch

from workbench.controller import ONE_TO_ALL, register
from workbench.hybrid.channel import ChannelAddress, TransferStats, WeightChannel, open_address
from workbench.hybrid.reallocate import Reallocator
from workbench.mesh import Mesh
from workbench.transfers import Param, Placement, layer_count, llama_layer, plan

Named = Iterable[tuple[str, torch.Tensor]]


class WeightChannelMember:
    """Registered open/join methods and the send/receive loops; the worker supplies what it sends
    (`send_weights`) and where what it receives goes (`receive_weights`). Listed after Worker
    among the bases: it uses the Worker's rank, device and record_span."""

    channel: WeightChannel | None = None
    channel_sources: int = 0
    """The trained group's ranks in the channel when it reallocates (all of them, channel ranks
    0..n-1; the copy's follow); 0 when the trained group's rank 0 broadcasts."""
    _reallocator: Reallocator | None = None

    if TYPE_CHECKING:  # the Worker's, which this is mixed into (declared for the type checker only)

        @property
        def rank(self) -> int: ...

        @property
        def device(self) -> torch.device: ...

        @property
        def mesh(self) -> Mesh: ...

        def record_span(self, name: str, start: float, end: float, **extra: Any) -> None: ...

    @register(ONE_TO_ALL, execute="rank_zero")
    def open_weight_channel(self, size: int, local: bool, shared_device: bool = False) -> ChannelAddress:
        """A rendezvous for a weight channel of `size` members, this rank its sender (rank 0);
        over gloo where members share a device (workbench.hybrid.channel)."""
        host = "127.0.0.1" if local else ray.util.get_node_ip_address()
        return open_address(size, local, host=host, backend="gloo" if shared_device else None)

    @register(ONE_TO_ALL)
    def join_weight_channel(self, address: ChannelAddress, first_rank: int, sources: int = 0) -> bool:
        """Join the channel at `address`: a trained group's rank 0 as its sender (first_rank=0),
        every rank of a receiving group as a receiver (channel rank first_rank + rank). With
        `sources` (the trained group's world size) the channel reallocates: every trained rank
        joins as a source. Collective over the channel's members: the driver calls both groups
        at once."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        self.channel_sources, self._reallocator = sources, None
        if first_rank == 0 and self.rank != 0 and not sources:
            return False  # the other training ranks only help gather (send_weights)
        self.channel = WeightChannel(address, first_rank + self.rank, self.device)
        return True

    def send_over_channel(self, named: Named, version: int, span: str) -> dict:
        """Rank 0 broadcasts `named` to the receivers; the other ranks run the iterator to its end
        (its gathers are collectives). One trace span with the bytes sent."""
        start = time.time()
        if self.rank == 0:
            if self.channel is None:
                raise RuntimeError("send_weights: no weight channel; connect one (workbench.workers.WeightLink)")
            stats = self.channel.send(named)
        else:
            stats = TransferStats(tensors=sum(1 for _ in named))
        self.record_span(span, start, time.time(), version=version, **stats.as_dict())
        return {"version": version, **stats.as_dict()}

    def receive_over_channel(self, load: Callable[[Iterator[tuple[str, torch.Tensor]]], None], version: int, span: str):
        """`load` the tensors the sender broadcasts, in place, one at a time. One trace span with
        the bytes received."""
        if self.channel is None:
            raise RuntimeError("receive_weights: no weight channel; connect one (workbench.workers.WeightLink)")
        start, stats = time.time(), TransferStats()
        incoming = self.channel.receive(stats)
        try:
            load(incoming)
        finally:
            for _ in incoming:  # a failed load still takes the rest: the sender must not hang
                pass
        rss = psutil.Process().memory_info().rss
        self.record_span(span, start, time.time(), version=version, peak_rss_bytes=rss, **stats.as_dict())
        return {"version": version, **stats.as_dict()}

    def reallocate_over_channel(
        self,
        version: int,
        span: str,
        engine=None,
        load: Callable[[Iterable[tuple[str, torch.Tensor]]], None] | None = None,
        pieces: dict[str, tuple[torch.Tensor, int | None]] | None = None,
    ) -> dict:
        """Move the trained group's weights into the copy by reallocation (the channel joined
        with `sources`). `pieces`, on either side: a tensor-parallel rank's own pieces,
        {name: (piece, the dim the weight is cut along, None: whole)}, sent from or filled in
        place as they are, in the worker's layout.
          * A source passes its `engine`, and its `pieces` when it trains tensor parallel;
            without them it gathers each layer unit from its FSDP shards (every source rank, a
            collective) and sends whole weights.
          * A copy rank passes its `pieces`, or `load` ((name, tensor) pairs into its model, in
            place: an FSDP replica's shards, a rollout engine's weights), called for each unit
            as it arrives, so neither side holds more than one unit beside its model (a vLLM
            engine's `load` keeps them all for its one reload, as a broadcast's does).
        Each side's layout and cuts come from its first rank, the weights' names and shapes from
        the first source, shared once per channel. One trace span with this rank's bytes and
        messages."""
        if self.channel is None or not self.channel_sources:
            raise RuntimeError(f"{span}: no reallocating weight channel; connect one (WeightLink, reallocate=True)")
        source = self.channel.rank < self.channel_sources
        if (engine is None) == source or (not source and (load is None) == (pieces is None)):
            raise ValueError(
                f"{span}: a source passes its engine (and its pieces), a copy rank a load function or its pieces"
            )
        start = time.time()
        if self._reallocator is None:  # planned once per channel: the layouts do not change
            self._reallocator = Reallocator(self._reallocation_plan(engine, pieces), self.channel.group, self.device)
        if source and pieces is not None:
            _, moved = self._reallocator.run({name: piece for name, (piece, _) in pieces.items()})
        elif source:
            _, moved = self._reallocator.run(lambda names: dict(engine.iter_full_weights(set(names).__contains__)))
        elif pieces is not None:
            _, moved = self._reallocator.run(None, out={name: piece for name, (piece, _) in pieces.items()})
            missing = sorted(set(self._reallocator.dest_shapes) - set(pieces))
            if missing:  # they landed in throwaway buffers (after the run: the sources must not hang)
                raise ValueError(f"{span}: this copy rank has no piece of {missing[:3]} to fill; is it the same model?")
        else:
            arrived: dict[str, torch.Tensor] = {}
            failed: list[Exception] = []
            assert load is not None

            def land(names: list[str]) -> None:
                units = [(name, arrived.pop(name)) for name in names]
                if not failed:  # after a failed load, take the rest: the sources must not hang
                    try:
                        load(iter(units))
                    except Exception as error:  # re-raised once every unit has arrived
                        failed.append(error)

            _, moved = self._reallocator.run(None, out=arrived, done=land)
            if failed:
                raise failed[0]
        rss = psutil.Process().memory_info().rss
        self.record_span(span, start, time.time(), version=version, peak_rss_bytes=rss, **moved.as_dict())
        return {"version": version, **moved.as_dict()}

    def _reallocation_plan(self, engine, pieces: dict[str, tuple[torch.Tensor, int | None]] | None):
        """The transfer plan, built alike on every member from what the two sides' first ranks
        share: the sources' layout (whole weights on p1t1dn after the gather, or their
        tensor-parallel layout) and the copy's, each with its cuts. Collective over the channel."""
        assert self.channel is not None
        n = self.channel_sources
        source = self.channel.rank < n
        cuts = {name: dim for name, (_, dim) in (pieces or {}).items() if dim is not None}
        mine = Mesh(1, 1, n) if source and pieces is None else self.mesh  # FSDP: whole after the gather
        weights, src, src_cuts = self.channel.share(
            (_weight_list(engine), mine, cuts) if self.channel.rank == 0 else None
        )
        dst, dst_cuts = self.channel.share((mine, cuts) if not source else None, root=n)
        for side, mesh, count in (("sources", src, n), ("copy", dst, self.channel.size - n)):
            if mesh.pp > 1 or mesh.world_size != count:
                raise ValueError(
                    f"reallocation: the {side}' layout {mesh} must be whole or tensor-parallel weights on its "
                    f"{count} channel ranks (pp = 1)"
                )
        clash = sorted(k for k in src_cuts.keys() & dst_cuts.keys() if src_cuts[k] != dst_cuts[k])
        if clash:
            raise ValueError(f"reallocation: the two layouts cut {clash[:3]} along different dims")
        n_layers = layer_count(name for name, _, _ in weights)
        params = [
            Param(name, shape, src_cuts.get(name, dst_cuts.get(name)), llama_layer(name, n_layers), dtype)
            for name, shape, dtype in weights
        ]
        return plan(params, Placement(src), Placement(dst, first=n))  # Placement drops generation layouts


def _weight_list(engine) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, full shape, dtype) of every weight of an engine's model, in its order (a DTensor's
    shape is the whole weight's, FSDP or tensor parallel)."""
    return [
        (name, tuple(value.shape), str(value.dtype).removeprefix("torch."))
        for name, value in engine.model.state_dict().items()
    ]
