"""WorkerGroup: the driver's handle on one role (actor, critic, ...) running SPMD on a pool.

Every method the worker class marks with @register becomes a driver method that returns a
DataFuture at once. Inputs are split per the method's protocol; DataFuture inputs travel as
RemoteSlices so each rank pulls its rows straight from the source ranks.

The processes themselves belong to a HostSet: one Ray actor per device, joined in one
torch.distributed process group. A plain group owns a HostSet alone; fused colocation puts
several roles in one HostSet, so they share processes (and memory) yet are called as
separate groups.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any

import ray

from workbench.controller.future import CallInfo, DataFuture, RemoteSlice, fetch, fetch_all
from workbench.controller.protocols import Protocol, first
from workbench.controller.register import Registration, registered_methods
from workbench.controller.resource_pool import ResourcePool
from workbench.controller.store_file import remove_store_file
from workbench.controller.worker import AFTER, META, TASK, TRACE_GROUP, WorkerHost, entry_name
from workbench.data.batch import Batch
from workbench.errors import DispatchError, GroupRemovedError, WorkerCallError, WorkerDiedError
from workbench.mesh import Mesh
from workbench.tracing import MAX_CALL_TAGS, CallRecord, CallTags, current_tags, new_call_number, take_answers

START_TIMEOUT_S = 300.0
"""How long a group's processes may take to start and answer (Ray places them, imports, threads).
Past it the start fails naming the ranks that are silent: a process Ray cannot place waits for
ever otherwise."""

_JOINT: ContextVar[list[tuple[ResourcePool, tuple]] | None] = ContextVar("joint_calls", default=None)
"""The calls issued so far inside a `joint_calls` block, (pool, (host set, refs)) each; None
outside one. A context variable: a thread of the driver's own is never inside another's block."""


@contextmanager
def joint_calls() -> Iterator[None]:
    """Calls issued inside run at once, even where their groups share devices: none waits for
    another one of the block, each still waits for what was issued on its devices before it.
    For calls that meet in one collective across groups (a weight channel's join and push between
    a trained group and a copy on some of its devices): under the per-device turns, the one issued
    second would wait for the first, which waits for it. After the block, a call on any of their
    devices waits for all of them."""
    if _JOINT.get() is not None:  # nested: the outer block decides
        yield
        return
    token = _JOINT.set([])
    try:
        yield
    finally:
        issued = _JOINT.get() or []
        _JOINT.reset(token)
        _take_turns_after(issued)


def _take_turns_after(issued: list[tuple[ResourcePool, tuple]]) -> None:
    """Each device's last call becomes the joint calls issued on it (their host set where it is
    one, else None: every group waits for them). Devices with the same calls share one list of
    refs, as one call's devices do (a later call asks each list once)."""
    on_device: dict[tuple[int, int], tuple[dict, list[int]]] = {}
    for k, (pool, _) in enumerate(issued):
        for device in pool.devices:
            on_device.setdefault((id(pool.last_calls), device), (pool.last_calls, []))[1].append(k)
    shared: dict[tuple[int, ...], tuple] = {}
    for (_, device), (last_calls, calls) in on_device.items():
        if tuple(calls) not in shared:
            hosts = {issued[k][1][0] for k in calls}
            refs = [ref for k in calls for ref in issued[k][1][1]]
            shared[tuple(calls)] = (next(iter(hosts)) if len(hosts) == 1 else None, refs)
        last_calls[device] = shared[tuple(calls)]


class HostSet:
    """One worker process per device of `pool`, in one process group, hosting `roles`."""

    def __init__(self, pool: ResourcePool, mesh: Mesh, threads: int, roles: dict[str, tuple[type, Any]]):
        name = "+".join(roles)
        if mesh.world_size != pool.world_size:
            raise DispatchError(
                f"group {name!r}: {mesh} has {mesh.world_size} ranks but pool {pool.name!r} has "
                f"{pool.world_size} devices; pick pp*tp*dp = {pool.world_size}"
            )
        if pool.placement is None:
            raise DispatchError(f"group {name!r}: pool {pool.name!r} was released; create it again")
        self.pool, self.mesh, self.roles = pool, mesh, list(roles)
        self.specs = dict(roles)
        self.configs = {role: config for role, (_, config) in roles.items()}
        self.identities: list[tuple[int, str, str] | None] = [None] * mesh.world_size
        """(pid, node id, node address) of each rank."""
        self.dead: tuple[int, str] | None = None
        """(rank, what Ray said) once a process of this set is known to be gone."""
        self.checkpoints: dict[str, str] = {}
        """role -> path of the last save_checkpoint(path) issued on it (session.recover reloads it)."""
        self.weight_links: dict[str, object] = {}
        """Each role's newest weight link (its token): a role's processes hold one weight channel."""
        backend, local = _transport(pool)
        self.key = warm_key(pool, threads)
        """What a warm process must match to serve this set (see ResourcePool.parked)."""
        self.call_tags = CallTags()
        """Tags of driver calls whose spans have not all been drained yet (see tag_call)."""
        self.task_calls: OrderedDict[bytes, int] = OrderedDict()
        """Ray task id -> driver call number, for rank tasks whose own span is not drained yet (see note_task)."""
        self.drains: list = []
        """drain_records calls that have not answered yet (the next drain collects them)."""
        self.store_file: str | None = None
        """The process group's FileStore (ranks on one machine), removed here when the ranks were
        killed before removing it themselves (a dead rank's set)."""
        warm = [pool.unpark(pool.devices[rank], self.key) for rank in range(mesh.world_size)]
        if None in warm:  # new processes need the shares that parked ones of other roles hold
            pool.evict(keep=self.key)
        self.hosts = []
        for rank, host in enumerate(warm):
            start = (pool.name, rank, mesh.world_size, threads, backend, local)
            if host is None:
                host = _remote_host().options(**pool.scheduling(rank)).remote(*start)
            else:  # runs before the calls below: an actor runs one caller's calls in order
                host.serve.remote(*start)
            self.hosts.append(host)
        try:
            ranks = list(range(mesh.world_size))
            self.identities = fetch_all(
                [h.identity.remote() for h in self.hosts],
                CallInfo(name, "start", ranks, starting=True),
                ranks,
                timeout=START_TIMEOUT_S,
            )
            address, port = fetch(
                self.hosts[0].rendezvous_address.remote(), CallInfo(name, "start", ranks, starting=True), 0
            )
            if address == "file" and self.identities[0] is not None:
                on_driver = self.identities[0][1] == ray.get_runtime_context().get_node_id()
                self.store_file = str(port) if on_driver else None  # another node's file is its own
            fetch_all(  # bounded inside: the ranks' store waits RENDEZVOUS_TIMEOUT_S for the others
                [h.init_process_group.remote(address, port) for h in self.hosts],
                CallInfo(name, "init_process_group", ranks, starting=True),
                ranks,
            )
            for role, (cls, config) in roles.items():
                fetch_all(
                    [h.add_role.remote(role, cls, config, mesh) for h in self.hosts],
                    CallInfo(role, f"{cls.__name__}.__init__", ranks, starting=True),
                    ranks,
                )
        except BaseException:
            self.shutdown()
            raise

    def change_generation(self, mesh: Mesh) -> None:
        """Move the live ranks to `mesh`, which differs from theirs only in how they generate
        (gen_pp, gen_tp, transition): each role's config checks it on the driver first
        (`check_layout`, as at start), then every rank's workers rebuild their generation side
        (`Worker.generation_changed`); weights, optimizer state and processes stay."""
        training = (self.mesh.pp, self.mesh.tp, self.mesh.dp)
        if (mesh.pp, mesh.tp, mesh.dp) != training:
            raise DispatchError(
                f"group {'+'.join(self.roles)!r}: {mesh} changes the training layout {self.mesh}; only "
                f"gen_pp, gen_tp and transition change on live processes (start a new group for another "
                f"(pp, tp, dp))"
            )
        for role, config in self.configs.items():
            check = getattr(config, "check_layout", None)
            if callable(check):
                check(mesh, role)
        ranks = list(range(mesh.world_size))
        fetch_all(
            [h.change_generation.remote(mesh) for h in self.hosts],
            CallInfo("+".join(self.roles), "change_generation", ranks),
            ranks,
        )
        self.mesh = mesh

    def tag_call(self, number: int, tags: dict, ranks: int) -> dict:
        """Keep the tags of driver call `number`, run on `ranks` ranks; the dict returned can
        still be added to (the algorithm's step clock adds iteration and step) until its spans
        are drained. They are dropped once every rank's span of the call has been drained (a
        rank's spans recorded inside the call come before its own), so a long run keeps only
        the tags of calls in flight; MAX_CALL_TAGS bounds those a dead rank never answers."""
        return self.call_tags.keep(number, tags, ranks)

    def note_task(self, ref: ray.ObjectRef, number: int) -> None:
        """Rank task of call `number` (by one of its refs): its spans name the task, and
        drain_records turns that into the number. Kept until the task's own span is drained,
        within MAX_CALL_TAGS calls' worth of tasks."""
        self.task_calls[ref.task_id().binary()] = number
        if len(self.task_calls) > MAX_CALL_TAGS * len(self.hosts):
            self.task_calls.popitem(last=False)

    def request_records(self) -> None:
        """Ask every rank for its spans (answered from the hosts' trace thread, beside any call
        in flight); `take_records` collects the answers."""
        self.drains += [h.drain_records.remote() for h in self.hosts]

    def where(self, rank: int) -> tuple[int | None, str | None]:
        """(pid, 'address/node-id prefix') of a rank, for error messages."""
        ident = self.identities[rank] if rank < len(self.identities) else None
        return (ident[0], f"{ident[2]}/{ident[1][:8]}") if ident else (None, None)

    def find_dead(self, timeout: float = 3.0) -> tuple[int, str] | None:
        """The first rank found dead, with Ray's words; None when every rank answers (or is busy
        past `timeout`, which says it is alive). Once found, the set stays marked dead."""
        if self.dead is not None or not self.hosts:
            return self.dead
        pings = [h.ping.remote() for h in self.hosts]
        ids = [h._actor_id.hex() for h in self.hosts]
        deadline = time.monotonic() + timeout
        while self.dead is None:
            ready, _ = ray.wait(pings, num_returns=len(pings), timeout=0.1, fetch_local=False)
            for rank, ref in enumerate(pings):
                if ref in ready:
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayActorError as err:
                        self.dead = (rank, str(err))
                        break
                elif actor_state(ids[rank]) == "DEAD":
                    self.dead = (rank, "Ray reports the process DEAD")
                    break
            if len(ready) == len(pings) or time.monotonic() > deadline:
                break
        return self.dead

    def busy_ranks(self, timeout: float = 1.0) -> list[int]:
        """Ranks that do not answer a ping within `timeout` (e.g. waiting in a collective)."""
        pings = [h.ping.remote() for h in self.hosts]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=timeout, fetch_local=False)
        return [rank for rank, ref in enumerate(pings) if ref not in ready]

    def died_error(self, role: str, method: str) -> WorkerDiedError:
        assert self.dead is not None, "died_error is asked only once a rank is known dead"
        rank, detail = self.dead
        pid, node = self.where(rank)
        return WorkerDiedError(role, rank, method, detail, pid=pid, node=node, fused=self.roles)

    def drain_records(self, timeout: float = 10.0) -> list[CallRecord]:
        """Spans from every rank. A rank that does not answer within `timeout` keeps its answer
        pending for the next drain, so no span is lost."""
        self.request_records()
        return self.take_records(wait_answers(self.drains, timeout))

    def take_records(self, answers: dict) -> list[CallRecord]:
        """The spans of this set's drain_records calls that `answers` ({ref: spans}, from
        `wait_answers`) holds, tagged with their calls' tags; calls not answered yet stay in
        `drains`."""
        records, self.drains = take_answers(self.drains, answers)
        tasks = [self._number_span(r) for r in records]
        for r in records:
            r.extra.update(self.call_tags.of(r.extra.get("call")))
        for r, task in zip(records, tasks):  # after tagging them all: a call's spans may share this drain
            if r.call_id < 0:  # an inner span (record_span), not the call's own
                continue
            if task is not None:
                self.task_calls.pop(task, None)
            self.call_tags.settle(r.extra.get("call"))
        return records

    def _number_span(self, record: CallRecord) -> bytes | None:
        """Put the driver call number first in a span's tags, in place of its Ray task (TASK)."""
        task_hex = record.extra.pop(TASK, None)
        task = bytes.fromhex(task_hex) if task_hex else None
        number = self.task_calls.get(task) if task is not None else None
        if number is not None:
            rest = dict(record.extra)
            record.extra.clear()
            record.extra.update({"call": number, **rest})
        return task

    def shutdown(self, timeout: float = 10.0, park: bool = False) -> None:
        """Stop the processes and wait until Ray reports them dead (their share of the pool is
        free). With `park`, live processes that can serve again are kept warm on the pool instead
        (ResourcePool.parked), every rank's or none: a new set takes them for the same key."""
        if self.hosts and self.dead is None:  # let live ranks close their process group first
            reset = [h.reset.remote() if park else h.shutdown.remote() for h in self.hosts]
            ready, _ = ray.wait(reset, num_returns=len(reset), timeout=10.0 if park else 2.0)
            if park and len(ready) == len(reset) and self.pool.placement is not None:
                try:
                    reusable = all(ray.get(reset))
                except ray.exceptions.RayError:
                    reusable = False
                if reusable:
                    self.pool.parked += [(self.pool.devices[r], self.key, h) for r, h in enumerate(self.hosts)]
                    self.hosts = []
                    return
        for host in self.hosts:
            ray.kill(host, no_restart=True)
        deadline = time.monotonic() + timeout
        ids = [h._actor_id.hex() for h in self.hosts]
        while time.monotonic() < deadline:
            if all(actor_state(i) in ("DEAD", None) for i in ids):
                break
            time.sleep(0.05)
        self.hosts = []
        if self.store_file is not None:  # a killed rank never let torch delete it
            remove_store_file(self.store_file)
            self.store_file = None


def _transport(pool: ResourcePool) -> tuple[str, bool]:
    """The process group's backend on `pool`, and whether its ranks share one machine (then
    every socket is on loopback)."""
    return ("nccl" if pool.resource == "GPU" else "gloo"), len(set(pool.node_ids)) == 1


def warm_key(pool: ResourcePool, threads: int) -> tuple:
    """What a warm process must match to serve a new set on `pool`: torch threads, transport and
    device share. Not the workers' classes: every host takes its calls through one entry
    (WorkerHost.call), so a process that hosted an actor can host a critic next."""
    return (threads, *_transport(pool), pool.max_colocate)


@functools.cache
def _remote_host() -> Any:
    """WorkerHost as a Ray actor class: one for every group, so Ray exports it once."""
    return ray.remote(concurrency_groups={TRACE_GROUP: 1})(WorkerHost)  # type: ignore[call-overload]  # not in Ray's stubs


def actor_state(actor_id: str) -> str | None:
    """Ray's state of an actor ("ALIVE", "DEAD", ...); None when Ray has no record of it."""
    info = ray._private.state.actors(actor_id=actor_id)
    return info.get("State") if info else None


@dataclass(frozen=True)
class MethodDispatch:
    """What every call of one registered method does alike on one group, worked out on its
    first call: which ranks run it, through which entry points, and how outputs come back."""

    method: str
    mesh: Mesh
    """The layout it was worked out for (a changed generation layout needs a new dispatch)."""
    registration: Registration
    ranks: list[int]
    entries: list
    """Each rank's entry point (a Ray method call to `.remote`), in `ranks` order."""
    collect_ranks: list[int]
    collect: Callable
    chunks: int | None
    """Data-parallel chunks a Batch input is split into (None: the protocol does not split)."""

    @classmethod
    def build(cls, role: str, method: str, registration: Registration, hostset: HostSet) -> MethodDispatch:
        mesh, protocol = hostset.mesh, registration.protocol
        collect: Callable
        if registration.execute == "rank_zero":
            ranks, collect_ranks, collect = [0], [0], first
        else:
            ranks, collect_ranks, collect = list(range(mesh.world_size)), protocol.collect_ranks(mesh), protocol.collect
        # A task on the host's WorkerHost.call, named after the entry (see there).
        entry, returns = entry_name(hostset.roles.index(role), method), 2 if registration.returns_rows else 1
        entries = [hostset.hosts[rank].call.options(num_returns=returns, name=entry) for rank in ranks]
        return cls(method, mesh, registration, ranks, entries, collect_ranks, collect, protocol.num_chunks(mesh))


class WorkerGroup:
    """Driver-side handle: registered methods of `cls`, called on every rank of a HostSet.

    A handle follows its role: when the session re-creates the group (re-running its cell,
    `session.recover`), calls on an old handle go to the new group; when the group is removed
    and not re-created, they raise GroupRemovedError naming the role and the cell to re-run.
    workbench.workers.handles types the handles of the shipped worker classes."""

    role: str

    def __init__(self, role: str, hostset: HostSet, cls: type):
        self.role, self._hostset, self._cls = role, hostset, cls
        self._methods: dict[str, Registration] = registered_methods(cls)
        self._dispatches: dict[str, MethodDispatch] = {}
        check = getattr(hostset.configs.get(role), "check_call", None)
        self._check_call: Callable | None = check if callable(check) else None
        self._successor: WorkerGroup | None = None
        self._removed: str | None = None

    def live(self) -> WorkerGroup:
        """The group this handle stands for now (itself, or the group that replaced it)."""
        group = self._latest()
        if group._removed is not None:
            raise GroupRemovedError(self.role, group._removed)
        return group

    def _latest(self) -> WorkerGroup:
        group = self
        while group._successor is not None:
            group = group._successor
        return group

    @property
    def hostset(self) -> HostSet:
        return self.live()._hostset

    @property
    def cls(self) -> type:
        return self._latest()._cls

    @property
    def methods(self) -> dict[str, Registration]:
        return self._latest()._methods

    @property
    def mesh(self) -> Mesh:
        return self.hostset.mesh

    @property
    def pool(self) -> ResourcePool:
        return self.hostset.pool

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def config(self):
        """The config its workers were built with (read-only here: rebuild the group to change it)."""
        return self.hostset.configs.get(self.role)

    def switch_generation(self, **changes) -> Mesh:
        """Generate in another layout from now on, on the live processes (weights, optimizer
        state and processes kept): `gen_tp=`, `gen_pp=` or the 3D-HybridEngine's `transition=`,
        e.g. the three transition methods compared on one actor. Roles fused into the same
        processes share the mesh and see the change too. Returns the new mesh."""
        allowed = ("gen_pp", "gen_tp", "transition")
        unknown = sorted(set(changes) - set(allowed))
        if unknown or not changes:
            raise DispatchError(
                f"{self.role}.switch_generation: name what changes, among {allowed}"
                + (f"; {unknown} change the training layout (start a new group for that)" if unknown else "")
            )
        hostset = self.live()._hostset
        mesh = replace(hostset.mesh, **changes)
        hostset.change_generation(mesh)
        return mesh

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        methods = self.methods
        if name not in methods:
            raise AttributeError(
                f"{self.role} ({self.cls.__name__}) has no registered method {name!r}; registered: "
                f"{sorted(methods)}. Mark worker methods with @register(...) to call them from the driver."
            )

        def call(*args, **kwargs) -> DataFuture:
            return self.call(name, *args, **kwargs)

        call.__name__ = name
        call.__doc__ = getattr(self.cls, name).__doc__
        return call

    def __dir__(self):
        return [*super().__dir__(), *self.methods]

    # ---- one call, step by step (each step runs on the live group) ----------------------------
    def call(self, method: str, *args, **kwargs) -> DataFuture:
        """Run registered `method` on the group; returns a DataFuture immediately."""
        group = self._callable(method)
        dispatch = group._dispatch(method)
        group._check_inputs(method, args, kwargs)
        per_rank = group._distribute(dispatch, args, kwargs)
        after = group._other_groups_pending()
        number, tags = group._tag(dispatch)
        metas, outputs = group._submit(dispatch, per_rank, after, number)
        group._remember_path(dispatch, args, kwargs)
        return group._future(dispatch, outputs, metas, tags)

    def _callable(self, method: str) -> WorkerGroup:
        """The live group, refused at once when one of its processes is known to be dead."""
        group = self.live()
        if group._hostset.dead is not None:  # before any remote work
            raise group._hostset.died_error(group.role, method)
        return group

    def _dispatch(self, method: str) -> MethodDispatch:
        dispatch = self._dispatches.get(method)
        if dispatch is None or dispatch.mesh is not self._hostset.mesh:
            registration = self._methods.get(method)
            if registration is None:
                raise DispatchError(
                    f"{self.role} has no registered method {method!r}; registered: {sorted(self._methods)}"
                )
            dispatch = self._dispatches[method] = MethodDispatch.build(self.role, method, registration, self._hostset)
        return dispatch

    def _check_inputs(self, method: str, args: tuple, kwargs: dict) -> None:
        """No reserved keyword names; the arguments fit the method's signature; then the
        config's own driver-side checks of them, by parameter name (`check_call`)."""
        reserved = [k for k in kwargs if k.startswith("_wb_")]
        if reserved:
            raise DispatchError(f"{self.role}.{method}: keyword names starting with _wb_ are reserved: {reserved}")
        signature = _signature(self.cls, method)
        if signature is None:
            return
        try:
            bound = signature.bind(None, *args, **kwargs)  # None for self
        except TypeError as e:
            raise DispatchError(f"{self.role}.{method}{signature}: {e}") from None
        if self._check_call is not None:
            bound.apply_defaults()
            self._check_call(self.role, method, dict(list(bound.arguments.items())[1:]))

    def _distribute(self, dispatch: MethodDispatch, args: tuple, kwargs: dict) -> list[tuple[tuple, dict]] | None:
        """Each rank's (args, kwargs), split per the method's protocol; None when there are none."""
        if not args and not kwargs:
            return None
        if dispatch.registration.execute == "rank_zero":
            return [(tuple(_whole(a) for a in args), {k: _whole(v) for k, v in kwargs.items()})]
        args = tuple(self._fit(dispatch, a) for a in args)  # every input fits before anything is stored
        kwargs = {k: self._fit(dispatch, v) for k, v in kwargs.items()}
        mesh, distribute = self._hostset.mesh, dispatch.registration.protocol.distribute
        spread_args = [_put_once(distribute(mesh, a)) for a in args]
        spread_kwargs = {k: _put_once(distribute(mesh, v)) for k, v in kwargs.items()}
        return [(tuple(a[r] for a in spread_args), {k: v[r] for k, v in spread_kwargs.items()}) for r in dispatch.ranks]

    def _fit(self, dispatch: MethodDispatch, value: Any) -> Any:
        """Pad (or refuse) a Batch whose rows do not divide into the protocol's chunks."""
        chunks = dispatch.chunks
        if not isinstance(value, Batch) or chunks is None or len(value) % chunks == 0:
            return value
        if not dispatch.registration.pad:
            raise DispatchError(
                f"{self.role}.{dispatch.method}: a Batch of {len(value)} rows does not split into "
                f"{chunks} equal data-parallel chunks ({self._hostset.mesh}); pass a multiple of {chunks} "
                f"rows, or register the method with pad=True"
            )
        return value.pad_to_multiple(chunks)

    def _other_groups_pending(self) -> list:
        """Other groups' last calls on this pool's devices, while unfinished: this call's ranks
        wait for them. (Calls of one host set already run in issue order, Ray's actor FIFO.)"""
        pool, pending, asked = self._hostset.pool, [], {}
        for device in pool.devices:
            last_hosts, last_refs = pool.last_calls.get(device, (None, []))
            if last_hosts is self._hostset or not last_refs:
                continue
            if id(last_refs) not in asked:  # one call's refs stand on each of its devices
                asked[id(last_refs)] = _unfinished(last_refs)
                pending += asked[id(last_refs)]
            pool.last_calls[device] = (last_hosts, asked[id(last_refs)])  # what finished need not be asked again
        return list(dict.fromkeys(pending))  # joint calls may stand on several devices in several lists

    def _tag(self, dispatch: MethodDispatch) -> tuple[int, dict]:
        """The call's number and its trace tags (kept until its spans are drained)."""
        number = new_call_number()
        return number, self._hostset.tag_call(number, current_tags(), len(dispatch.ranks))

    def _submit(self, dispatch: MethodDispatch, per_rank: list | None, after: list, number: int) -> tuple[list, list]:
        """One task per rank: its inputs, the metas of its RemoteSlices (top-level arguments, so
        Ray ships their values) and what it waits for; each task is noted as part of call
        `number` (see TASK). The pool keeps the refs: another group's next call on it waits."""
        hostset, reserved = self._hostset, {AFTER: after} if after else {}
        metas, outputs = [], []
        for i, entry in enumerate(dispatch.entries):
            if per_rank is None:
                result = entry.remote(**reserved)
            else:
                rank_args, rank_kwargs = per_rank[i]
                result = entry.remote(*rank_args, **rank_kwargs, **_slice_metas(rank_args, rank_kwargs), **reserved)
            if dispatch.registration.returns_rows:
                metas.append(result[0])
                result = result[1]
            hostset.note_task(result, number)
            outputs.append(result)
        last = (self._hostset, metas or outputs)
        joint = _JOINT.get()
        if joint is not None:  # the block's calls take their turn together, when it ends
            joint.append((hostset.pool, last))
        else:
            hostset.pool.last_calls.update(dict.fromkeys(hostset.pool.devices, last))
        return metas, outputs

    def _remember_path(self, dispatch: MethodDispatch, args: tuple, kwargs: dict) -> None:
        """A method registered with remembers_path saves the role's state: keep where, for
        session.recover."""
        if dispatch.registration.remembers_path and (args or "path" in kwargs):
            self._hostset.checkpoints[self.role] = str(kwargs.get("path", args[0] if args else None))

    def _future(self, dispatch: MethodDispatch, outputs: list, metas: list, tags: dict) -> DataFuture:
        future: DataFuture = DataFuture(
            CallInfo(self.role, dispatch.method, dispatch.ranks, self._hostset),
            outputs,
            metas if dispatch.registration.returns_rows else None,
            dispatch.collect_ranks,
            dispatch.collect,
            self._hostset.mesh,
        )
        future.trace_tags = tags  # StepClock.launch adds the iteration and step
        return future

    def __repr__(self) -> str:
        group = self._latest()
        if group._removed is not None:
            return f"WorkerGroup({self.role!r}, removed: {group._removed})"
        state = ", DEAD" if group._hostset.dead is not None else ""
        return f"WorkerGroup({self.role!r}, {group._cls.__name__}, pool={group.pool.name!r}, {group.mesh}{state})"


def _slice_metas(args: tuple, kwargs: dict) -> dict[str, Any]:
    """The metas of a rank's RemoteSlice inputs, as numbered reserved keyword arguments."""
    metas = [
        m for v in (*args, *kwargs.values()) if isinstance(v, RemoteSlice) and v.metas is not None for m in v.metas
    ]
    return {f"{META}{k:04d}": m for k, m in enumerate(metas)}


def _whole(value: Any) -> Any:
    return value.slice(0, 1) if isinstance(value, DataFuture) else value


def _put_once(values: list[Any]) -> list[Any]:
    """A Batch that goes to several ranks is stored once in the object store, and the ranks share
    the reference. A Batch for one rank travels as a plain argument: Ray inlines a small one
    into the task (a put costs a few ms more) and stores a large one itself."""
    shared = Counter(id(v) for v in values if isinstance(v, Batch))
    stored: dict[int, Any] = {}
    out = []
    for v in values:
        if isinstance(v, Batch) and shared[id(v)] > 1:
            if id(v) not in stored:
                stored[id(v)] = ray.put(v)
            v = stored[id(v)]
        out.append(v)
    return out


def wait_answers(drains: list, timeout: float) -> dict:
    """{call: its spans} for the drain_records calls (of any ranks or scorers) that answer
    within `timeout`, waited for together and fetched at once. A dead process's spans died
    with it: its answer is []."""
    ready, _ = ray.wait(drains, num_returns=len(drains), timeout=timeout) if drains else ([], [])
    try:
        return dict(zip(ready, ray.get(ready)))
    except ray.exceptions.RayActorError:  # a process died: the others' answers one by one
        return {ref: _answer(ref) for ref in ready}


@functools.cache
def _signature(cls: type, method: str) -> inspect.Signature | None:
    """The worker method's signature, self first (None where Python cannot tell it)."""
    try:
        return inspect.signature(getattr(cls, method))
    except (TypeError, ValueError):
        return None


def _answer(ref) -> list[CallRecord]:
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError:
        return []


def _unfinished(refs: list) -> list:
    if not refs:
        return []
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
    return pending


__all__ = ["WorkerGroup", "HostSet", "Protocol", "WorkerCallError", "joint_calls"]
