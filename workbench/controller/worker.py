"""Worker: the base of every model's SPMD worker, and the host process that runs it.

One WorkerHost (a Ray actor) runs per device of a pool. It joins the group's
torch.distributed process group (gloo on CPU, NCCL on GPU), then holds one Worker per role:
a plain group has one role, a fused group several (e.g. actor + reference sharing a
process and its memory). The driver calls `WorkerHost.call`, which waits for earlier calls
on the same pool, resolves RemoteSlice inputs, runs the method and records a trace span.
"""

from __future__ import annotations

import functools
import gc
import os
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import psutil
import ray
import torch
import torch.distributed as dist

from workbench.controller.future import RemoteSlice, describe_output
from workbench.controller.register import registered_methods
from workbench.controller.store_file import new_store_file, remove_store_file
from workbench.data.batch import PAD_KEY, Batch
from workbench.mesh import Coord, Mesh
from workbench.tracing import CallRecord, process_memory, reset_memory_peaks


@functools.cache
def node_address() -> str:
    """The address of this process's host as Ray knows it (its node's IP): a span's `node`."""
    return ray.util.get_node_ip_address()


@dataclass(frozen=True)
class RankContext:
    """What a worker knows about its place in the group."""

    role: str
    rank: int
    world_size: int
    mesh: Mesh
    pool: str
    device: str
    backend: str
    records: deque
    """The host's trace buffer (Worker.record_span appends to it)."""
    current: dict | None = None
    """Tags of the call this rank is running (its Ray task, see TASK), for record_span."""


class Worker:
    """Base class for model workers. Subclass it and mark driver-callable methods with @register.

    Inside any method (and in __init__), `self.rank`, `self.world_size`, `self.mesh`,
    `self.coord` (pp, tp, dp), `self.device` and the default torch.distributed process group
    (the whole group) are ready; `self.device_mesh` gives torch DeviceMesh sub-groups by name.
    """

    context: RankContext

    def __init__(self, config: Any = None):
        self.config = config

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def world_size(self) -> int:
        return self.context.world_size

    @property
    def mesh(self) -> Mesh:
        return self.context.mesh

    @property
    def coord(self) -> Coord:
        return self.context.mesh.coord(self.context.rank)

    @property
    def device(self) -> torch.device:
        return torch.device(self.context.device)

    def record_span(self, name: str, start: float, end: float, **extra) -> None:
        """Add a span of this rank's own (e.g. a weight sync) to the session's trace."""
        c = self.context
        c.records.append(
            CallRecord(
                call_id=-1,
                role=c.role,
                method=name,
                rank=c.rank,
                pool=c.pool,
                pid=os.getpid(),
                node=node_address(),
                start=start,
                fetched=start,
                end=end,
                bytes_in=0,
                bytes_out=0,
                ok=True,
                extra={**(c.current or {}), **extra},
            )
        )

    def generation_changed(self, previous: Mesh) -> None:
        """Called on every rank once the driver moved the group to a mesh that generates
        differently (`WorkerGroup.switch_generation`); `self.mesh` is already the new one.
        Workers that do not generate have nothing to rebuild."""

    @property
    def device_mesh(self):
        """torch DeviceMesh over ("dp", "pp", "tp"), built on first use (it creates sub-groups)."""
        if getattr(self, "_device_mesh", None) is None:
            from torch.distributed.device_mesh import init_device_mesh

            m = self.mesh
            self._device_mesh = init_device_mesh(
                self.device.type, (m.dp, m.pp, m.tp), mesh_dim_names=("dp", "pp", "tp")
            )
        return self._device_mesh


# Reserved keyword arguments of host entry points: refs of earlier calls to wait for, and the
# metas of RemoteSlice inputs (top-level, so Ray ships their values with the task).
AFTER = "_wb_after"
META = "_wb_meta_"
# A span's tag naming the Ray task it was recorded in; the driver, which knows the task of each
# rank of each call it made, turns it into the call's number when it drains the span. Sending
# the number with the call would cost every call an argument, serialized on both sides: about
# a tenth of a no-argument call's round trip. (A unique task name per call would do it too,
# but Ray keeps per-name state: memory grew ~2 KB per call.)
TASK = "_wb_task"
# drain_records runs in its own thread (Ray concurrency group), so spans reach the driver while
# a long call holds the host's main thread.
TRACE_GROUP = "trace"
MAX_RECORDS = 100_000  # trace spans kept per worker between two session.trace() calls
RENDEZVOUS_TIMEOUT_S = 300.0
"""How long a new group's ranks wait for each other to join its process group (its store's
timeout). The driver starts them together, so a rank that has not joined by then never will (its
process died, or rank 0's store is unreachable): the start fails and names it, instead of
torch's 30 minutes."""


def process_wide_state() -> list[str]:
    """Libraries whose state outlives the workers that used them: a process holding any is not
    kept warm for another group. vLLM once imported; DeepSpeed once its comm was set up (an
    engine ran). Importing DeepSpeed alone leaves nothing behind, and transformers imports it
    whenever it saves a model: counting that kept few model workers warm."""
    held = ["vllm"] if "vllm" in sys.modules else []
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None and comm.cdb is not None:
        held.append("deepspeed")
    return held


def loopback_env() -> dict[str, str]:
    """Environment that keeps a process's own listening sockets on the loopback interface:
    gloo's and NCCL's connection listeners, and vLLM's host address. Used for groups whose
    ranks all sit on one machine (their peers are local, so nothing needs another interface)."""
    iface = next(
        (
            name
            for name, addrs in psutil.net_if_addrs().items()
            if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs)
        ),
        "lo",
    )
    return {
        "GLOO_SOCKET_IFNAME": iface,
        "NCCL_SOCKET_IFNAME": iface,
        "VLLM_HOST_IP": "127.0.0.1",
        "MASTER_ADDR": "127.0.0.1",
    }


def node_env(address: str) -> dict[str, str]:
    """Environment for a rank of a group spanning nodes: gloo's connection listener on the
    interface that holds this node's Ray address, and vLLM's host address. Left to itself gloo
    listens on the address the hostname resolves to, which is loopback on many machines
    (Debian's 127.0.1.1, a container's 127.0.0.1): peers on other nodes would be sent there and
    refused. NCCL chooses its own interface (never loopback); NCCL_SOCKET_IFNAME overrides it."""
    iface = next(
        (
            name
            for name, addrs in psutil.net_if_addrs().items()
            if any(a.family == socket.AF_INET and a.address == address for a in addrs)
        ),
        None,
    )
    return {"VLLM_HOST_IP": address} | ({"GLOO_SOCKET_IFNAME": iface} if iface else {})


class WorkerHost:
    """The Ray actor behind one rank: its roles' methods run through `call`."""

    def __init__(self, pool: str, rank: int, world_size: int, threads: int, backend: str, local: bool = False):
        self.serve(pool, rank, world_size, threads, backend, local)
        self.own_threads = {t.ident for t in threading.enumerate()}

    def serve(self, pool: str, rank: int, world_size: int, threads: int, backend: str, local: bool = False) -> None:
        """Take rank `rank` of a new group: at start, or as a warm process kept from an old group."""
        if local:  # set before any library opens a socket: see loopback_env
            os.environ.update(loopback_env())
        else:  # see node_env; what the caller's runtime_env set wins
            for key, value in node_env(node_address()).items():
                os.environ.setdefault(key, value)
        self.local = local
        torch.set_num_threads(threads)
        self.pool, self.rank, self.world_size, self.backend = pool, rank, world_size, backend
        self.device = "cuda" if backend == "nccl" else "cpu"
        if self.device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes only this actor's GPU
        self.workers: dict[str, Worker] = {}
        self.roles: list[str] = []
        """The roles added, in order: entry r{i}__* runs roles[i]'s method."""
        self.entries: dict[str, tuple[str, str, bool]] = {}
        """entry name -> (role, method, whether outputs come back as (meta, output))."""
        # Bounded, so a long run whose driver never asks for its trace cannot grow without end.
        self.records: deque[CallRecord] = deque(maxlen=MAX_RECORDS)
        self.counts: dict[tuple[str, str], int] = {}
        self.current: dict = {}
        self.store_file: str | None = None

    def rendezvous_address(self) -> tuple[str, int | str]:
        """Where the group's process-group store lives, chosen by rank 0.

        A group on one machine shares a FileStore in a fresh private directory: no port at
        all. A group spanning nodes needs torch's TCPStore, hosted by rank 0 on its node's
        address (torch binds that store on every interface; it has no authentication)."""
        if self.local:
            self.store_file = new_store_file("workbench-store-")
            return "file", self.store_file
        with socket.socket() as s:
            s.bind((node_address(), 0))
            port = s.getsockname()[1]
        return node_address(), port

    def init_process_group(self, address: str, port: int | str) -> None:
        timeout = timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
        if address == "file":
            store: dist.Store = dist.FileStore(str(port), self.world_size)
            store.set_timeout(timeout)
        else:
            os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port))
            store = dist.TCPStore(address, int(port), self.world_size, is_master=self.rank == 0, timeout=timeout)
        dist.init_process_group(self.backend, store=store, rank=self.rank, world_size=self.world_size)

    def identity(self) -> tuple[int, str, str]:
        """(pid, node id, node address) of this process, named in errors about it."""
        return os.getpid(), ray.get_runtime_context().get_node_id(), node_address()

    def add_role(self, role: str, cls: type[Any], config: Any, mesh: Mesh) -> None:
        worker = object.__new__(cls)  # the context is set before __init__ runs
        worker.context = RankContext(
            role,
            self.rank,
            self.world_size,
            mesh,
            self.pool,
            self.device,
            self.backend,
            self.records,
            self.current,
        )
        worker.__init__(*(() if config is None else (config,)))
        self.workers[role] = worker
        for method, registration in registered_methods(cls).items():
            self.entries[entry_name(len(self.roles), method)] = (role, method, registration.returns_rows)
        self.roles.append(role)

    def call(self, *args, **kwargs):
        """Every driver call of a worker's method arrives here, as a task named after its entry
        (entry_name): the host's Ray class is one whatever workers it hosts, so a warm process
        serves a group of any worker classes. The entry travels as the task's name, not as an
        argument: Ray charges per argument (one more made a no-op call ~8% slower, bench/dispatch.py),
        and a name per entry is bounded state. The driver asks Ray for two returns where the
        method's outputs may be split by rows: then (meta, output)."""
        role, method, with_meta = self.entries[ray.get_runtime_context().get_task_name()]
        return self.run(role, method, with_meta, args, kwargs)

    def change_generation(self, mesh: Mesh) -> None:
        for worker in self.workers.values():
            previous = worker.context.mesh
            worker.context = replace(worker.context, mesh=mesh)
            worker.generation_changed(previous)

    def run(self, role: str, method: str, with_meta: bool, args: tuple, kwargs: dict):
        """Run one call of role.method; returns output, or (OutputMeta, output) with_meta."""
        after = kwargs.pop(AFTER, None)
        tags = {TASK: ray.get_runtime_context().get_task_id()}
        slice_metas = [kwargs.pop(k) for k in sorted(k for k in kwargs if k.startswith(META))]
        _attach_metas((*args, *kwargs.values()), slice_metas)
        if after:  # time-sharing: earlier calls on this pool, issued by other groups, go first
            ray.wait(after, num_returns=len(after), fetch_local=False)
        start = time.time()
        args = tuple(self._on_device(resolve_input(a)) for a in args)
        kwargs = {k: self._on_device(resolve_input(v)) for k, v in kwargs.items()}
        metas_in = [describe_output(v) for v in (*args, *kwargs.values())]
        bytes_in = sum(m.nbytes for m in metas_in)
        rows_in = sum(m.rows for m in metas_in if m.rows is not None)
        compute_start = time.time()
        sequence = self.counts[role, method] = self.counts.get((role, method), -1) + 1
        self.current.clear()
        self.current.update(tags)
        ok = False
        try:
            output = getattr(self.workers[role], method)(*args, **kwargs)
            output = _keep_padding_marks(args, output)
            if isinstance(output, Batch) and self.device != "cpu":
                output = output.to("cpu")  # the driver and other pools take CPU tensors
            ok = True
        finally:
            meta_out = describe_output(output) if ok else None
            self.records.append(
                CallRecord(
                    call_id=sequence,
                    role=role,
                    method=method,
                    rank=self.rank,
                    pool=self.pool,
                    pid=os.getpid(),
                    node=node_address(),
                    start=start,
                    fetched=compute_start,
                    end=time.time(),
                    bytes_in=bytes_in,
                    bytes_out=meta_out.nbytes if meta_out else 0,
                    ok=ok,
                    # Rows in and out: what a timeline's hover shows beside the bytes; the
                    # process's memory peaks so far (every role's memory, per process).
                    extra={
                        **tags,
                        "rows": rows_in,
                        "rows_out": meta_out.rows if meta_out else None,
                        **process_memory(),
                    },
                )
            )
            self.current.clear()
        return (meta_out, output) if with_meta else output

    def _on_device(self, value: Any) -> Any:
        """A Batch argument arrives on this rank's device: workers compute where their model is."""
        return value.to(self.device) if isinstance(value, Batch) and self.device != "cpu" else value

    @ray.method(concurrency_group=TRACE_GROUP)
    def drain_records(self) -> list[CallRecord]:
        """Hand over the spans recorded so far. Runs beside a call in flight: popleft is atomic,
        so a span appended meanwhile stays for the next drain instead of being lost."""
        records = []
        while True:
            try:
                records.append(self.records.popleft())
            except IndexError:
                return records

    def ping(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()  # a FileStore's file goes with its last user
        if self.local and self.rank == 0 and self.store_file:
            remove_store_file(self.store_file)

    def reset(self) -> bool:
        """Leave the group and drop its workers, so that a later group of the same roles can
        take this process (`Session(keep_processes=True)`). False when it must not serve again:
        a library with process-wide state was loaded (vLLM's engine, DeepSpeed's groups), or a
        worker left a thread or a child process running."""
        self.shutdown()
        self.workers.clear()
        self.roles.clear()
        self.entries.clear()
        self.records.clear()
        if "torch._dynamo" in sys.modules:  # imported by whatever compiled
            torch._dynamo.reset()  # compiled graphs hold their models
        if "torch.distributed.tensor" in sys.modules:
            # DTensor's sharding caches outlive a process group: meshes compare equal whatever
            # their groups, so a cached answer would hand the next group's weights this one's
            # mesh, whose groups are gone.
            from torch.distributed.tensor.debug import _clear_sharding_prop_cache

            _clear_sharding_prop_cache()
        gc.collect()
        reset_memory_peaks()  # the trace's memory peaks are the next group's own
        return (
            not process_wide_state()
            and not [t for t in threading.enumerate() if t.ident not in self.own_threads and not _rays(t)]
            and not psutil.Process().children()
        )


def _rays(thread: threading.Thread) -> bool:
    """Threads Ray runs Python on (a concurrency group's, seen as dummies) are not a worker's."""
    return isinstance(thread, threading._DummyThread)


def entry_name(slot: int, method: str) -> str:
    """The entry of `method` of a host's role number `slot` (in the order roles were added), not
    of the role's name: what a driver call names in WorkerHost.call (`r0__generate_sequences`)."""
    return f"r{slot}__{method}"


def _attach_metas(values: tuple, metas: list) -> None:
    start = 0
    for value in values:
        if isinstance(value, RemoteSlice) and value.metas is not None:
            value.meta_values = list(metas[start : start + len(value.metas)])
            start += len(value.metas)


def resolve_input(value: Any) -> Any:
    """Fetch inputs that arrive by reference: a stored Batch, or a slice of another call's output."""
    if isinstance(value, ray.ObjectRef):
        return ray.get(value)
    if isinstance(value, RemoteSlice):
        return value.resolve()
    return value


def _keep_padding_marks(args: tuple, output: Any) -> Any:
    """A method that builds a fresh Batch row-for-row from its input keeps the padding marks."""
    if not isinstance(output, Batch) or PAD_KEY in output.tensors.keys():
        return output
    for arg in args:
        if isinstance(arg, Batch) and PAD_KEY in arg.tensors.keys() and len(arg) == len(output):
            output.tensors[PAD_KEY] = arg.tensors[PAD_KEY]
            break
    return output
