"""Session: the single controller. In a notebook, the kernel holds one and calls through it.

    session = Session(num_devices=4)                 # embedded local Ray (or address=...)
    pool = session.pool("actor_pool", 2)
    critic = session.group("critic", CriticWorker, pool, config)
    batch = critic.compute_values(prompts).get()

A process has at most one live Session. Re-running the `Session(...)` cell returns that same
Session, reset: every group and pool it made is released first (no orphaned actors or
placement groups), and Ray keeps running unless the new arguments ask for a different one
(another num_devices, address or runtime_env of a Ray the session started). `shutdown()`
releases everything the session made, and stops Ray when the session started it.

The session owns pools and groups by name. Re-running a cell that creates a group (or pool)
with a name already in use replaces the old one; everything is checked on the driver first,
so a refused change leaves the old one as it was. Handles follow their role: calls on an old
handle go to its replacement (see WorkerGroup).

Network: in a single-machine group, every socket the workbench opens itself is on loopback
(the process-group rendezvous is a FileStore, gloo/NCCL listeners and vLLM use 127.0.0.1).
A group spanning nodes uses its nodes' addresses and torch's TCPStore on rank 0's node. Ray's
own servers (GCS, raylet, object manager, core workers) listen on every interface in Ray 2.60
whatever the workbench asks; Ray's token authentication guards them (on by default for an
embedded Ray; on a `ray start` cluster with RAY_AUTH_MODE=token on every host: docs/cluster.md).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import os
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, overload

import ray
from ray.util.placement_group import remove_placement_group

from workbench import checks
from workbench.controller.resource_pool import LOST_HOST, ResourcePool, check_devices, check_hosts, wait_for_hosts
from workbench.controller.worker import Worker
from workbench.controller.worker_group import HostSet, WorkerGroup, wait_answers, warm_key
from workbench.errors import (
    ConfigError,
    DispatchError,
    GroupRemovedError,
    PlacementError,
    SessionClosedError,
    WorkbenchError,
)
from workbench.mesh import Mesh
from workbench.ray_settings import START_TIMED_OUT, SYSTEM_CONFIG
from workbench.tracing import CallRecord, SpanSource, save_chrome_trace, span_sources

if TYPE_CHECKING:  # for the typed handles of Session.group (importing workers loads the model stack)
    from workbench.workers.actor import ActorRolloutRefWorker
    from workbench.workers.critic import CriticWorker
    from workbench.workers.handles import ActorHandle, CostModelHandle, CriticHandle, RewardModelHandle
    from workbench.workers.reward import CostModelWorker, RewardModelWorker

MAX_WARM_PROCESSES = 8
"""Worker processes a session keeps warm at most (each holds torch's libraries, ~0.5 GB)."""
# Worker processes get these unless the caller's runtime_env says otherwise: one BLAS thread
# each (torch threads are set per worker), and quiet tokenizers.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


_TRACE_LOCK = threading.RLock()
"""Serializes `Session.trace()`: its drains keep pending requests in lists shared by callers."""


STARTS = 2
"""Tries at starting a local Ray (see start_local_ray)."""


def start_local_ray(**init: Any) -> None:
    """ray.init(**init) for a Ray of this process's own. Ray gives its raylet a fixed 30 s to
    register; on a machine under load (a test suite, a build beside it) a start can miss that
    once. What the failed start left running is ended, and Ray is started again from scratch."""
    import psutil

    me = psutil.Process()
    for attempt in range(1, STARTS + 1):
        before = {p.pid for p in me.children()}
        try:
            ray.init(**init)
            return
        except Exception as error:
            if attempt == STARTS or START_TIMED_OUT not in str(error):
                raise
            ray.shutdown()
            _end(started_by_ray(me, before))
            print(
                f"Ray's start timed out (machine under load?); starting it again (try {attempt + 1} of {STARTS})",
                file=sys.stderr,
            )


def started_by_ray(me: Any, before: set[int]) -> list[Any]:
    """The processes a Ray start of this process made: its new children that run Ray's own code
    (gcs_server, raylet, log monitor: a path in Ray's package on their command line), and
    everything under them. Children of this process's other work are left alone."""
    import psutil

    package = os.path.dirname(ray.__file__)
    found = []
    for child in me.children():
        try:
            if child.pid not in before and any(package in part for part in child.cmdline()):
                found += [child, *child.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return found


def _end(processes: list[Any]) -> None:
    import psutil

    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(processes, timeout=10)  # the retry starts on freed cores


class Session:
    """Starts or attaches to Ray and owns the run's pools and worker groups (one per process)."""

    _live: ClassVar[Session | None] = None

    def __new__(cls, *args, **kwargs):
        # Re-running the Session cell: hand back the live session; __init__ resets it.
        if Session._live is not None and type(Session._live) is cls:
            return Session._live
        return super().__new__(cls)

    def __init__(
        self,
        num_devices: int | None = None,
        address: str | None = None,
        threads_per_worker: int = 1,
        max_colocate: int = 4,
        runtime_env: dict | None = None,
        max_trace_records: int | None = 20_000,
        keep_processes: bool = False,
    ):
        """
        num_devices: logical devices of an embedded local Ray (CPU slots when there is no GPU);
            default: the machine's CPU count (or, on a re-run, the running Ray's). Ignored when attaching.
        address: attach to this Ray cluster ("auto" or host:port); default: $RAY_ADDRESS if set,
            else start an embedded local Ray.
        threads_per_worker: torch threads in each worker process (keep cores x 1 >= workers).
        max_colocate: how many separate worker processes may share one device of a pool.
        runtime_env: Ray runtime_env for the workers (env_vars are added to WORKER_ENV).
        max_trace_records: trace spans the session keeps for `trace()`: the newest ones; older
            spans are dropped (counted in `dropped_records`), so a long run's driver memory stays
            bounded (a span is about 1.2 KB). None keeps every span. Also settable later as
            `session.max_trace_records`.
        keep_processes: keep the worker processes of removed groups warm (at most
            MAX_WARM_PROCESSES, with their pools' reservations), so that a new group of the same
            worker classes on a pool of the same shape starts on them: a re-run cell or a test
            saves the seconds a process takes to start and import torch. A process that loaded
            vLLM or DeepSpeed, or left a thread or child running, is never kept. Worker code
            edited on disk since a process imported it needs a fresh one: clear() with this off.
            Also settable later as `session.keep_processes`.
        """
        _check_arguments(num_devices, address, threads_per_worker, max_colocate, runtime_env, max_trace_records)
        if not isinstance(keep_processes, bool):
            raise ConfigError("Session.keep_processes", keep_processes, "pass True or False")
        if getattr(self, "_started", False):  # a re-run of the Session cell
            self.clear(reason="the Session(...) cell was re-run")
        else:
            self.pools: dict[str, ResourcePool] = {}
            self.groups: dict[str, WorkerGroup] = {}
            self.records: list[CallRecord] = []
            """The newest trace spans drained so far, in start order (see max_trace_records)."""
            self.dropped_records = 0
            """Spans dropped from `records` to keep it within max_trace_records."""
            self.spans_arrived = 0
            """Spans drained since the session began: the cursor `spans_since` counts in."""
            self._arrivals: list[CallRecord] = []  # the newest spans, in the order they arrived
            self._handles: dict[str, WorkerGroup] = {}  # newest handle per role, live or removed
            self._pool_versions = itertools.count()
            self._spares: list[ResourcePool] = []  # released pools kept for their parked processes
            self.owns_ray = False
            self._ray_args: tuple | None = None
        self.id = uuid.uuid4().hex[:8]  # names this session's placement groups
        self.threads_per_worker = threads_per_worker
        self.max_trace_records = max_trace_records
        self.max_colocate = max_colocate
        self.keep_processes = keep_processes
        self._closed = False
        self._start_ray(num_devices, address or os.environ.get("RAY_ADDRESS"), runtime_env)
        self._started = True
        Session._live = self

    def _start_ray(self, num_devices: int | None, address: str | None, runtime_env: dict | None) -> None:
        env = {"env_vars": {**WORKER_ENV, **(runtime_env or {}).get("env_vars", {})}}
        runtime_env = {**(runtime_env or {}), **env}
        if ray.is_initialized():
            if not self.owns_ray or self._ray_args is None:
                return  # attached to a Ray someone else started: use it as it is
            old_devices, old_address, old_env = self._ray_args
            same = address == old_address and runtime_env == old_env and num_devices in (None, old_devices)
            if same:
                return
            ray.shutdown()  # ours, and asked to differ: start it again as asked
        self.owns_ray = not ray.is_initialized()
        if address:
            ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
            self._ray_args = (None, address, runtime_env)
        else:
            devices = num_devices or os.cpu_count()
            # Workers at the driver's priority, no idle task workers (workbench.ray_settings).
            start_local_ray(
                num_cpus=devices, include_dashboard=False, runtime_env=runtime_env, _system_config=dict(SYSTEM_CONFIG)
            )
            self._ray_args = (devices, None, runtime_env)

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError(
                "this Session was shut down (session.shutdown()); create a new one with Session(...)"
            )

    # ---- pools ---------------------------------------------------------------------------
    def pool(
        self,
        name: str,
        devices: int | list[int],
        max_colocate: int | None = None,
        hosts: list[str] | tuple[str, ...] = (),
    ) -> ResourcePool:
        """Reserve devices: an int fills nodes in order, a list asks for that many devices on
        each of distinct nodes (e.g. [2, 2]). `hosts` (node addresses or ids) puts the pool on
        those nodes: for a list, one host per entry, in order (e.g. the critic on one host, the
        reward model on another). Re-creating a pool with the same name and shape returns it;
        a new shape replaces it and removes the groups on it. The new devices are checked (and,
        where they fit beside the old pool, reserved) before anything is released: a refused
        change leaves the old pool and its groups as they were."""
        self._check_open()
        if not isinstance(name, str) or not name:
            raise ConfigError("pool name", name, "give the pool a non-empty string name")
        devices = check_devices(name, devices)
        max_colocate = self.max_colocate if max_colocate is None else max_colocate
        checks.whole(
            f"pool {name!r}", "max_colocate", max_colocate, fix="use a whole number >= 1 (worker processes per device)"
        )
        old = self.pools.get(name)
        if old is not None and old.parent is not None:
            raise ConfigError("pool name", name, f"it names a slice of pool {old.parent!r}; pick another name")
        hosts = check_hosts(name, devices, () if hosts is None else hosts)  # before any spare is given up
        if old is not None and old.has_shape(devices, max_colocate, hosts):
            return old
        spare = self._take_spare(devices, max_colocate, hosts)
        if spare is not None:  # a kept reservation of this shape, with its warm processes
            if old is not None:
                self._drop_pool(name, reason=f"its pool {name!r} was re-created with devices={devices!r}")
            self.pools[name] = spare = dataclasses.replace(spare, name=name, last_calls={})
            return spare
        # Check first, counting the old pool's devices as free: refusal changes nothing.
        self._plan(name, devices, exclude=old.placement if old else None, hosts=hosts)
        label = f"workbench:{self.id}:{name}:{next(self._pool_versions)}"
        if old is not None:
            try:  # beside the old pool when there is room; the old one stays until this succeeds
                self._plan(name, devices, hosts=hosts)
                fits_beside = True
            except Exception:
                fits_beside = False
            if not fits_beside:  # it needs the old pool's devices: release it, then reserve
                self._drop_pool(name, reason=f"its pool {name!r} was re-created with devices={devices!r}")
                self._plan(name, devices, hosts=hosts)  # and a spare made of it gives them back
        pool = ResourcePool.reserve(name, devices, label, max_colocate, hosts=hosts)
        if name in self.pools:
            self._drop_pool(name, reason=f"its pool {name!r} was re-created with devices={devices!r}")
        self.pools[name] = pool
        return pool

    def slice(self, name: str, pool: ResourcePool | str, first: int, size: int) -> ResourcePool:
        """A pool of devices [first, first + size) of `pool` (e.g. the reference on d0-1 while
        the actor trains on d0-3): groups on it share those devices with the groups on `pool`
        and on its other slices, and calls on shared devices run in the order issued. It goes
        with its pool. Re-creating a slice with the same name and devices returns it."""
        self._check_open()
        parent = self._pool(pool)
        if parent.parent is not None:
            raise ConfigError("slice of", parent.name, f"slice pool {parent.parent!r} itself (a slice has no slices)")
        if not isinstance(name, str) or not name or (name in self.pools and self.pools[name].parent != parent.name):
            raise ConfigError("slice name", name, "give the slice a non-empty name that no pool of this session has")
        piece = parent.slice(name, first, size)
        old = self.pools.get(name)
        if old is not None:
            if old.devices == piece.devices:
                return old
            self._drop_pool(name, reason=f"its slice {name!r} was re-created over other devices")
        self.pools[name] = piece
        return piece

    def release(self, pool: str | ResourcePool) -> None:
        """Give back a pool's devices and tear down the groups on it (and any role fused with
        them), keeping every other pool and group: e.g. the pools of a plan deployed before,
        when the next one is deployed beside them. Their handles then say which pool went."""
        self._check_open()
        name = pool.name if isinstance(pool, ResourcePool) else pool
        if name not in self.pools:
            raise ConfigError("pool", name, f"this session has no such pool; its pools: {sorted(self.pools)}")
        self._drop_pool(name, reason=f"its pool {name!r} was released (session.release)")

    def _drop_pool(self, name: str, reason: str | None = None) -> None:
        for piece in [p.name for p in self.pools.values() if p.parent == name]:  # its slices go with it
            self._drop_pool(piece, reason)
        for role, group in list(self.groups.items()):
            if role in self.groups and group.pool.name == name:
                self._drop_group(role, reason or f"its pool {name!r} was released")
        self._release(self.pools.pop(name))

    def _release(self, pool: ResourcePool) -> None:
        """Give a pool's devices back, or keep its reservation as a spare for its warm processes."""
        if self.keep_processes and pool.parent is None and pool.parked:
            self._spares.append(pool)
            self._limit_warm()
        else:
            pool.release()

    def _take_spare(self, devices: int | list[int], max_colocate: int, hosts: tuple = ()) -> ResourcePool | None:
        """A spare of this shape, taken off the list; None when there is none."""
        for spare in self._spares:
            if spare.has_shape(devices, max_colocate, hosts) and not spare.lost_nodes():
                self._spares.remove(spare)
                return spare
        return None

    def _plan(self, name: str, devices: int | list[int], exclude=None, hosts: tuple = ()) -> None:
        """ResourcePool.plan, giving up the spares when their devices are needed."""
        try:
            ResourcePool.plan(name, devices, exclude, hosts)
        except PlacementError:
            if not self._spares:
                raise
            self._drop_spares()
            ResourcePool.plan(name, devices, exclude, hosts)

    def _warm_up(self, pool: ResourcePool) -> None:
        """Give an unused pool the reservation of a spare of its shape whose parked processes
        can serve it (pools are made before their groups, so the spare it got may hold none)."""
        key = warm_key(pool, self.threads_per_worker)
        in_use = any(g.pool.shares_devices(pool) for g in self.groups.values()) or any(
            p.parent == pool.name for p in self.pools.values()
        )
        if pool.parent is not None or in_use or any(k == key for _, k, _ in pool.parked):
            return
        for spare in self._spares:
            if spare.has_shape(pool.devices_per_node, pool.max_colocate, pool.hosts) and any(
                k == key for _, k, _ in spare.parked
            ):
                for field in ("placement", "node_ids", "parked", "last_calls"):  # in place: handles hold `pool`
                    mine, theirs = getattr(pool, field), getattr(spare, field)
                    setattr(pool, field, theirs)
                    setattr(spare, field, mine)
                if not spare.parked:
                    self._spares.remove(spare)
                    spare.release()
                return

    def _drop_spares(self) -> None:
        for spare in self._spares:
            spare.release()  # its parked processes go with the placement group
        self._spares.clear()

    def _limit_warm(self) -> None:
        """At most MAX_WARM_PROCESSES parked: the oldest spares go first, then live pools' oldest."""
        live = [p for p in self.pools.values() if p.parent is None]  # a slice shares its parent's list
        excess = sum(len(p.parked) for p in (*self._spares, *live)) - MAX_WARM_PROCESSES
        while excess > 0 and self._spares:
            spare = self._spares.pop(0)
            excess -= len(spare.parked)
            spare.release()
        for pool in live:
            if excess <= 0:
                break
            for _, _, host in pool.parked[:excess]:
                ray.kill(host, no_restart=True)
            dropped = len(pool.parked[:excess])
            del pool.parked[:excess]
            excess -= dropped

    # ---- groups ----------------------------------------------------------------------------
    # The shipped worker classes give typed handles (workbench.workers.handles), other classes a
    # WorkerGroup. A typed handle is a WorkerGroup at run time, so the overloads do overlap.
    @overload
    def group(  # type: ignore[overload-overlap]
        self,
        role: str,
        worker_cls: type[ActorRolloutRefWorker],
        pool: ResourcePool | str,
        config: Any = None,
        mesh: Mesh | None = None,
    ) -> ActorHandle: ...
    @overload
    def group(  # type: ignore[overload-overlap]
        self,
        role: str,
        worker_cls: type[CriticWorker],
        pool: ResourcePool | str,
        config: Any = None,
        mesh: Mesh | None = None,
    ) -> CriticHandle: ...
    @overload
    def group(  # type: ignore[overload-overlap]
        self,
        role: str,
        worker_cls: type[CostModelWorker],
        pool: ResourcePool | str,
        config: Any = None,
        mesh: Mesh | None = None,
    ) -> CostModelHandle: ...
    @overload
    def group(  # type: ignore[overload-overlap]
        self,
        role: str,
        worker_cls: type[RewardModelWorker],
        pool: ResourcePool | str,
        config: Any = None,
        mesh: Mesh | None = None,
    ) -> RewardModelHandle: ...
    @overload
    def group(
        self,
        role: str,
        worker_cls: type[Worker],
        pool: ResourcePool | str,
        config: Any = None,
        mesh: Mesh | None = None,
    ) -> WorkerGroup: ...

    def group(
        self,
        role: str,
        worker_cls: type[Worker],
        pool: ResourcePool | str,
        config: Any = None,
        mesh: Mesh | None = None,
    ) -> WorkerGroup:
        """One worker of `worker_cls` per device of `pool`, called as `role`.

        mesh: its (pp, tp, dp) layout; default pure data parallelism over the pool."""
        return self.fused(pool, mesh=mesh, **{role: (worker_cls, config)})[role]

    def fused(
        self, pool: ResourcePool | str, mesh: Mesh | None = None, **roles: tuple[type, Any] | type
    ) -> dict[str, WorkerGroup]:
        """Several roles in one process per device (e.g. actor and reference), each its own group:

        groups = session.fused(pool, actor=(ActorWorker, cfg), reference=(RefWorker, cfg))

        Everything is checked on the driver before the old groups of these roles stop: the
        classes, the mesh against the pool, each config's own checks for this layout
        (`config.check_layout(mesh, role)`: parallelism the worker implements, batch sizes,
        model directories)."""
        self._check_open()
        pool = self._pool(pool)
        if not roles:
            raise DispatchError("session.fused: name at least one role, e.g. actor=(ActorWorker, config)")
        mesh = mesh or Mesh.data_parallel(pool.world_size)
        if not isinstance(mesh, Mesh):
            raise ConfigError("mesh", mesh, "pass a workbench.Mesh(pp=..., tp=..., dp=...) or None")
        if mesh.world_size != pool.world_size:
            raise DispatchError(
                f"group {'+'.join(roles)!r}: {mesh} has {mesh.world_size} ranks but pool {pool.name!r} has "
                f"{pool.world_size} devices; pick pp*tp*dp = {pool.world_size}"
            )
        specs = {role: spec if isinstance(spec, tuple) else (spec, None) for role, spec in roles.items()}
        for role, spec in specs.items():
            if len(spec) != 2 or not isinstance(spec[0], type) or not issubclass(spec[0], Worker):
                raise TypeError(f"role {role!r}: expected a Worker subclass or (WorkerClass, config), got {spec!r}")
            check = getattr(spec[1], "check_layout", None)
            if callable(check):
                check(mesh, role)
        replaced = {id(self.groups[r].hostset) for r in specs if r in self.groups}
        for device in pool.devices:  # processes per device, with the pool's slices and parent
            sharing = {
                id(g.hostset) for g in self.groups.values() if g.pool.shares_devices(pool) and device in g.pool.devices
            }
            if len(sharing - replaced) + 1 > pool.max_colocate:
                raise DispatchError(
                    f"pool {pool.name!r} already runs {len(sharing - replaced)} separate group(s) on its "
                    f"device {device}, its max_colocate; fuse roles into one process (session.fused) or "
                    f"create the pool with a larger max_colocate"
                )
        for role in specs:
            if role in self.groups:
                self._drop_group(role, f"it was being re-created, and starting the new {role!r} failed")
        if self.keep_processes:
            self._warm_up(pool)
        try:
            hostset = HostSet(pool, mesh, self.threads_per_worker, specs)
        except BaseException as error:
            for role in specs:  # handles of these roles name the failure
                self._mark_removed(role, f"starting it failed ({type(error).__name__}); see the error of that cell")
            raise
        groups = {role: WorkerGroup(role, hostset, cls) for role, (cls, _) in specs.items()}
        for role, group in groups.items():
            previous = self._handles.get(role)
            if previous is not None:
                previous._successor = group  # old handles follow the role to its new group
            self._handles[role] = group
        self.groups.update(groups)
        return groups

    def _pool(self, pool: ResourcePool | str) -> ResourcePool:
        name = pool if isinstance(pool, str) else getattr(pool, "name", None)
        if name not in self.pools or self.pools[name].placement is None:
            raise DispatchError(
                f"no pool named {name!r} in this session (pools: {sorted(self.pools)}); create it "
                f"with session.pool({name!r}, devices) first"
            )
        return self.pools[name]

    def _drop_group(self, role: str, reason: str = "it was removed") -> None:
        """Tear down the processes behind `role` (and any role fused with it)."""
        hostset = self.groups[role].hostset
        with _TRACE_LOCK:
            self._keep_records(hostset.drain_records())
        hostset.shutdown(park=self.keep_processes)
        if self.keep_processes:
            self._limit_warm()
        for name in hostset.roles:
            self.groups.pop(name, None)
            self._mark_removed(
                name, reason if name == role else f"{reason}, and {name!r} shared its processes with {role!r}"
            )

    def _mark_removed(self, role: str, reason: str) -> None:
        latest = self._handles.get(role)
        if latest is not None and latest._successor is None:
            latest._removed = reason

    # ---- recovery ------------------------------------------------------------------------------
    def recover(
        self,
        role: str,
        checkpoint: str | os.PathLike | None = None,
        lost_host: str = "remaining",
        wait: float = 120.0,
    ) -> WorkerGroup:
        """Start `role`'s group again on its pool with the same classes, configs and mesh (with
        every role fused with it), e.g. after a worker died. Weights come from `checkpoint`, or
        else from the last `save_checkpoint(path)` issued on the role, when that path exists;
        otherwise the workers start from their configs. Old handles follow the new group.

        When a host of the pool is gone (its node died or dropped off the network), the pool is
        reserved again first, with as many devices: on the cluster's remaining capacity
        (lost_host="remaining"), or on the same hosts once they are back (lost_host="rejoin",
        waiting up to `wait` seconds for them), and every other group on that pool is started
        again with it. Groups on other pools of the lost host: `lost_roles()`."""
        self._check_open()
        if lost_host not in LOST_HOST:
            raise ConfigError("session.recover lost_host", lost_host, f"give one of {list(LOST_HOST)}")
        latest = self._handles.get(role)
        if latest is None:
            raise DispatchError(
                f"session.recover({role!r}): this session never had a group {role!r}; roles: {sorted(self._handles)}"
            )
        old = latest._hostset
        if old.pool.name not in self.pools or self.pools[old.pool.name].placement is None:
            raise GroupRemovedError(role, f"its pool {old.pool.name!r} is gone, so it cannot be recovered in place")
        if checkpoint and not Path(checkpoint).exists():
            raise ConfigError(f"session.recover({role!r}) checkpoint", str(checkpoint), "no such path on this machine")
        pool = self.pools[old.pool.name]
        root = self.pools[pool.parent] if pool.parent else pool
        removed: list[str] = []
        for attempt in (1, 2):
            lost = root.lost_nodes()
            removed += self._reserve_again(root, lost, lost_host, wait) if lost else []
            try:
                group = self._restart(role, checkpoint)
                break
            except WorkbenchError:
                # A host whose processes died may still count as alive until the head's health
                # checks give it up; a start there then fails once they do: reserve again.
                if attempt == 2 or not root.lost_nodes():
                    raise
        failed: list[Exception] = []
        for other in dict.fromkeys(removed):  # the other groups of that pool, on its new reservation
            if other not in group.hostset.roles and other not in self.groups:
                try:
                    self._restart(other, None)
                except Exception as err:  # the others still start; the first failure is raised
                    failed.append(err)
        if failed:
            raise failed[0]
        return group

    def lost_roles(self) -> list[str]:
        """A role of each pool that lost a host: `recover` on it restarts every group of the pool."""
        roles, seen = [], set()
        for role, group in self.groups.items():
            pool = group.pool
            root = self.pools.get(pool.parent, pool) if pool.parent else pool
            if root.name not in seen and root.placement is not None and root.lost_nodes():
                roles.append(role)
                seen.add(root.name)
        return roles

    def _restart(self, role: str, checkpoint: str | os.PathLike | None) -> WorkerGroup:
        """`role`'s group (and those fused with it) started again on its pool, weights reloaded."""
        old = self._handles[role]._hostset
        checkpoints = {**old.checkpoints, **({role: str(checkpoint)} if checkpoint else {})}
        if checkpoint and not Path(checkpoint).exists():
            raise ConfigError(f"session.recover({role!r}) checkpoint", str(checkpoint), "no such path on this machine")
        groups = self.fused(self.pools[old.pool.name], mesh=old.mesh, **old.specs)
        for name, path in checkpoints.items():
            if name in groups and "load_checkpoint" in groups[name].methods and Path(path).exists():
                groups[name].load_checkpoint(path).get()
        groups[role].hostset.checkpoints.update(checkpoints)
        return groups[role]

    def _reserve_again(self, root: ResourcePool, lost: dict[str, str], how: str, wait: float) -> list[str]:
        """A new reservation for a pool that lost hosts (`lost`: node id -> address), swapped into
        the pool (and its slices) in place: handles hold the pool object. The roles whose groups
        were on it (removed with the old reservation)."""
        gone = sorted(set(lost.values()))
        reason = f"its pool {root.name!r} lost host(s) {gone} and was reserved again"
        removed = []
        for name in [root.name, *(p.name for p in self.pools.values() if p.parent == root.name)]:
            for role, group in list(self.groups.items()):
                if role in self.groups and group.pool.name == name:
                    removed.append(role)
                    self._drop_group(role, reason)
        address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        hosts = [address.get(n, lost.get(n, "?")) for n in dict.fromkeys(root.node_ids)]
        devices: int | list[int]
        on: tuple[str, ...]
        deadline = time.monotonic() + wait
        if how == "rejoin":  # the same hosts, device for device, once they are back
            devices, on = list(root.devices_per_node), tuple(hosts)
            wait_for_hosts(root.name, on, wait)
        else:  # as many devices, wherever they are free now
            devices, on = root.world_size, ()
        remove_placement_group(root.placement)
        self._drop_spares()  # warm spares may hold what the pool needs now (or sit on the lost host)
        label = f"workbench:{self.id}:{root.name}:{next(self._pool_versions)}"
        try:
            left = max(1.0, deadline - time.monotonic())
            new = ResourcePool.reserve(root.name, devices, label, root.max_colocate, timeout=left, hosts=on)
        except PlacementError as err:
            root.placement = None  # not usable: recover() and groups on it say the pool is gone
            raise PlacementError(
                f"{err}. Its groups {removed} were removed with the lost host(s) {gone}: free devices or "
                f"bring the host(s) back, then create the pool and its groups again"
            ) from None
        root.placement, root.node_ids, root.devices_per_node = new.placement, new.node_ids, new.devices_per_node
        root.hosts = on  # where it is now (a later pool(..., hosts=...) compares with this)
        root.parked.clear()
        root.last_calls.clear()
        for piece in self.pools.values():
            if piece.parent == root.name:
                piece.placement, piece.node_ids = root.placement, [root.node_ids[b] for b in piece.devices]
                piece.devices_per_node = [piece.node_ids.count(n) for n in dict.fromkeys(piece.node_ids)]
                piece.hosts = on
        return removed

    # ---- tracing and lifetime ----------------------------------------------------------------
    def trace(self, timeout: float = 10.0) -> list[CallRecord]:
        """Every call's span records so far (the newest `max_trace_records` of them), from
        every live worker and rule-reward scorer, in start order. They answer beside the calls
        they are running, so this is cheap while work is in flight; the host sets are asked at
        once, and all of them share `timeout` seconds."""
        with _TRACE_LOCK:  # one drain at a time: a live timeline drains on its own thread
            self._drain(timeout)
            return list(self.records)

    def spans_since(self, cursor: int = 0, timeout: float = 10.0) -> tuple[list[CallRecord], int]:
        """The spans drained after `cursor` (in arrival order), and the cursor to pass next
        time: what a view that follows a long run needs, at the cost of the new spans only
        (`trace()` copies every span held). Spans already dropped (max_trace_records) are not
        returned; `cursor=0` gives every span still held."""
        with _TRACE_LOCK:
            self._drain(timeout)
            new = min(self.spans_arrived - cursor, len(self._arrivals))
            return (self._arrivals[-new:] if new > 0 else []), self.spans_arrived

    def _drain(self, timeout: float) -> None:
        """Ask every rank and every other span source (rule-reward scorers) at once, then wait
        for all their answers together; one that does not answer within `timeout` keeps its
        call pending, answered at the next drain."""
        hostsets = {id(g.hostset): g.hostset for g in self.groups.values()}.values()
        sources: list[HostSet | SpanSource] = [*hostsets, *span_sources()]
        for source in sources:
            source.request_records()
        answers = wait_answers([ref for source in sources for ref in source.drains], timeout)
        self._keep_records([r for source in sources for r in source.take_records(answers)])

    def _keep_records(self, new: list[CallRecord]) -> None:
        """Add drained spans, in start order, keeping the newest max_trace_records."""
        if not new:
            return
        new = sorted(new, key=_start)
        # New spans start near the end: re-sort only the tail they fall into, not every span held.
        at = bisect.bisect_right(self.records, new[0].start, key=_start)
        self.records[at:] = sorted([*self.records[at:], *new], key=_start)
        self._arrivals += new
        self.spans_arrived += len(new)
        excess = len(self.records) - self.max_trace_records if self.max_trace_records is not None else 0
        if excess > 0:
            del self.records[:excess]
            del self._arrivals[:excess]  # as many as `records`: the newest arrivals
            self.dropped_records += excess

    def save_trace(self, path: str | Path) -> Path:
        """Write a Chrome/Perfetto trace JSON of all calls so far."""
        return save_chrome_trace(self.trace(), path)

    def clear(self, reason: str = "session.clear() removed every group") -> None:
        """Tear down every group and pool but keep Ray running (start a fresh layout)."""
        if not ray.is_initialized():  # Ray was stopped under us: its actors are gone already
            for role in list(self.groups):
                self._mark_removed(role, reason)
            self.groups.clear()
            self.pools.clear()
            self._spares.clear()
            return
        for role in list(self.groups):
            if role in self.groups:
                self._drop_group(role, reason)
        for name in list(self.pools):
            self._release(self.pools.pop(name))
        if not self.keep_processes:
            self._drop_spares()

    def shutdown(self) -> None:
        """Release every group and pool this session made; stop Ray if the session started it."""
        if getattr(self, "_closed", True):
            return
        self.clear(reason="session.shutdown() was called")
        self._drop_spares()
        rule_reward = sys.modules.get("workbench.workers.rule_reward")
        if rule_reward is not None and ray.is_initialized():  # scorer processes started for this run
            rule_reward.stop_scorers()
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()
        self._closed = True
        if Session._live is self:
            Session._live = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"pools={list(self.pools)}, groups={list(self.groups)}"
        return f"Session({state})"


def _check_arguments(num_devices, address, threads_per_worker, max_colocate, runtime_env, max_trace_records) -> None:
    """Session(...)'s arguments, refused with what to pass instead before anything starts."""
    checks.whole(
        "Session",
        "num_devices",
        num_devices,
        none_ok=True,
        fix="use a whole number of devices >= 1, or None for the CPU count",
    )
    checks.whole(
        "Session",
        "threads_per_worker",
        threads_per_worker,
        fix="use a whole number >= 1 (torch threads per worker)",
    )
    checks.whole("Session", "max_colocate", max_colocate, fix="use a whole number >= 1 (worker processes per device)")
    checks.whole(
        "Session",
        "max_trace_records",
        max_trace_records,
        none_ok=True,
        fix="use a whole number of spans >= 1, or None to keep every span",
    )
    if address is not None and not isinstance(address, str):
        raise ConfigError("Session.address", address, 'pass "auto", "host:port", or None for an embedded Ray')
    if runtime_env is not None and not isinstance(runtime_env, dict):
        raise ConfigError("Session.runtime_env", runtime_env, "pass a Ray runtime_env dict, e.g. {'env_vars': {...}}")


def _start(record: CallRecord) -> float:
    return record.start
