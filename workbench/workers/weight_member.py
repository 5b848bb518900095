"""A worker's membership of weight channels (workbench.hybrid.channel): the registered methods a
driver-side link (workbench.workers.rollout_link.WeightLink) calls to join a trained group's
rank 0 with every rank of a copy of the model on other devices, and the send and receive loops
that record what moved in the trace.

Mixed into the workers whose weights travel between pools: the actor (to a rollout group) and
the critic (to a replica that computes values on other devices, a per-call plan's)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import psutil
import ray
import torch

from workbench.controller import ONE_TO_ALL, register
from workbench.hybrid.channel import ChannelAddress, TransferStats, WeightChannel, open_address

Named = Iterable[tuple[str, torch.Tensor]]


class WeightChannelMember:
    """Registered open/join methods and the send/receive loops; the worker supplies what it sends
    (`send_weights`) and where what it receives goes (`receive_weights`). Listed after Worker
    among the bases: it uses the Worker's rank, device and record_span."""

    channel: WeightChannel | None = None

    @register(ONE_TO_ALL, execute="rank_zero")
    def open_weight_channel(self, size: int, local: bool, shared_device: bool = False) -> ChannelAddress:
        """A rendezvous for a weight channel of `size` members, this rank its sender (rank 0);
        over gloo where members share a device (workbench.hybrid.channel)."""
        host = "127.0.0.1" if local else ray.util.get_node_ip_address()
        return open_address(size, local, host=host, backend="gloo" if shared_device else None)

    @register(ONE_TO_ALL)
    def join_weight_channel(self, address: ChannelAddress, first_rank: int) -> bool:
        """Join the channel at `address`: a trained group's rank 0 as its sender (first_rank=0),
        every rank of a receiving group as a receiver (channel rank first_rank + rank). Collective
        over the channel's members: the driver calls both groups at once."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if first_rank == 0 and self.rank != 0:
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
