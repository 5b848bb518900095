"""A weight channel: one process group of its own joining a trained model's rank 0 with every
rank of a rollout group on other devices, to move weights between pools (asynchronous RL).

Each group already has its own torch.distributed world; a channel is a second, separate process
group (gloo here, NCCL on GPUs) built from a store, so two worlds can talk without merging them.
Where two members share a device (a copy of the model on devices its home holds) the channel
runs over gloo whatever the device: NCCL does not put two ranks of one communicator on one GPU,
and gloo moves CUDA tensors through host memory. The sender is channel rank 0; rollout rank r is
channel rank 1 + r. Tensors travel one at a time, each a broadcast from rank 0 preceded by a
small header (name, shape, dtype), so a receiver needs no manifest and never holds more than one
incoming tensor beside its model.
"""

from __future__ import annotations

import pickle
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from workbench.controller.store_file import new_store_file, remove_store_file
from workbench.errors import WeightSyncError

DEFAULT_TIMEOUT = timedelta(hours=1)
"""How long a member waits for the others: a rollout finishes its generation in flight before it
takes the weights, and the sender waits for it."""


@dataclass(frozen=True)
class ChannelAddress:
    """Where the channel's store lives and how many members it has."""

    kind: str
    """ "file" (every member on one machine: a FileStore, no port) or "tcp" (a TCPStore)."""
    where: str
    """The FileStore's path, or the TCPStore's host."""
    size: int
    port: int = 0
    backend: str | None = None
    """ "gloo" on every device (members share one), or None: NCCL on CUDA, gloo otherwise."""


def open_address(size: int, local: bool, host: str = "127.0.0.1", backend: str | None = None) -> ChannelAddress:
    """A fresh rendezvous for `size` members, made on the member that will be rank 0
    (backend="gloo" where members share a device)."""
    if backend not in (None, "gloo"):
        raise ValueError(f"weight channel backend {backend!r}: use None (by device) or 'gloo'")
    if local:
        return ChannelAddress("file", new_store_file("workbench-channel-"), size, backend=backend)
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return ChannelAddress("tcp", host, size, port, backend)


def open_group(address: ChannelAddress, rank: int, device: torch.device | str, timeout=DEFAULT_TIMEOUT):
    """(process group, its store): a group of its own for the `address.size` members, beside
    whatever world each member's pool has (NCCL on CUDA unless the address says gloo, gloo
    otherwise). Every member calls it with its own rank; the weight channel and
    `workbench.hybrid.reallocate` build theirs so."""
    if address.kind == "file":
        store: dist.Store = dist.FileStore(address.where, address.size)
    else:
        store = dist.TCPStore(
            address.where, address.port, address.size, is_master=rank == 0, timeout=timeout, wait_for_workers=True
        )
    if torch.device(device).type == "cuda" and address.backend is None:
        return dist.ProcessGroupNCCL(store, rank, address.size), store  # type: ignore[attr-defined]
    if address.kind == "file":  # one machine: gloo where the member's own group put it
        return dist.ProcessGroupGloo(store, rank, address.size, timeout), store
    # Members on several nodes. A member whose own group sits on one node has gloo pinned to
    # loopback (GLOO_SOCKET_IFNAME): its channel listens on the address that reaches rank 0's.
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=source_address(address.where, address.port))]
    return dist.ProcessGroupGloo(store, rank, address.size, options), store


def source_address(host: str, port: int) -> str:
    """This machine's address on the route to host:port (a UDP socket's connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


@dataclass
class TransferStats:
    """What one transfer moved, on one member."""

    seconds: float = 0.0
    tensors: int = 0
    bytes_sent: int = 0
    """Rank 0: tensor bytes times receivers (what a broadcast delivers); 0 elsewhere."""
    bytes_received: int = 0
    names: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "seconds": self.seconds,
            "tensors": self.tensors,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
        }


class WeightChannel:
    """This process's membership of one channel: for a broadcast rank 0 sends and the others
    receive; a reallocation (workbench.hybrid.reallocate) runs on its `group` with every trained
    rank a source."""

    def __init__(self, address: ChannelAddress, rank: int, device: torch.device, timeout=DEFAULT_TIMEOUT):
        self.address, self.rank, self.size, self.device = address, rank, address.size, torch.device(device)
        self.group, self.store = open_group(address, rank, self.device, timeout)

    def _broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = root
        self.group.broadcast([tensor], options).wait()

    def share(self, value: Any, root: int = 0) -> Any:
        """Member `root`'s `value` on every member (pickled; the others pass anything, e.g.
        None). Collective over the channel."""
        payload = pickle.dumps(value) if self.rank == root else b""
        length = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        self._broadcast(length, root)
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        if self.rank == root:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self._broadcast(data, root)
        return pickle.loads(data.cpu().numpy().tobytes())

    def send(self, named: Iterable[tuple[str, torch.Tensor]]) -> TransferStats:
        """Broadcast every (name, tensor) to the receivers, one at a time (rank 0 only)."""
        if self.rank != 0:
            raise WeightSyncError(f"weight channel: rank {self.rank} cannot send; only rank 0 sends")
        stats, start = TransferStats(), time.perf_counter()
        for name, tensor in named:
            tensor = tensor.detach().to(self.device).contiguous()
            self.share((name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")))
            self._broadcast(tensor)
            stats.tensors += 1
            stats.bytes_sent += tensor.numel() * tensor.element_size() * (self.size - 1)
            stats.names.append(name)
        self.share(None)
        stats.seconds = time.perf_counter() - start
        return stats

    def receive(self, stats: TransferStats | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) as rank 0 sends them; each tensor is a fresh buffer, yours to load
        before the next one arrives. `stats` (when given) counts what came."""
        if self.rank == 0:
            raise WeightSyncError("weight channel: rank 0 sends; receivers are ranks 1..size-1")
        start = time.perf_counter()
        while (header := self.share(None)) is not None:
            name, shape, dtype = header
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
            self._broadcast(tensor)
            if stats is not None:
                stats.tensors += 1
                stats.bytes_received += tensor.numel() * tensor.element_size()
                stats.names.append(name)
            yield name, tensor
        if stats is not None:
            stats.seconds = time.perf_counter() - start

    def close(self) -> None:
        if self.address.kind == "file" and self.rank == 0:
            remove_store_file(self.address.where)
        self.group = None  # type: ignore[assignment]
