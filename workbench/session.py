"""Session: the single controller. In a notebook, the kernel holds one and calls through it.

    session = Session(num_devices=4)                 # embedded local Ray (or address=...)
    pool = session.pool("actor_pool", 2)
    critic = session.group("critic", CriticWorker, pool, config)
    batch = critic.compute_values(prompts).get()

The session owns pools and groups by name. Re-running a cell that creates a group (or pool)
with a name already in use tears the old one down first, so a notebook never leaks actors.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import ray

from workbench.controller.mesh import Mesh
from workbench.controller.resource_pool import ResourcePool
from workbench.controller.worker_group import HostSet, WorkerGroup
from workbench.errors import DispatchError
from workbench.tracing import CallRecord, save_chrome_trace

# Worker processes get these unless the caller's runtime_env says otherwise: one BLAS thread
# each (torch threads are set per worker), and quiet tokenizers.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


class Session:
    """Starts or attaches to Ray and owns the run's pools and worker groups."""

    def __init__(
        self,
        num_devices: int | None = None,
        address: str | None = None,
        threads_per_worker: int = 1,
        max_colocate: int = 4,
        runtime_env: dict | None = None,
    ):
        """
        num_devices: logical devices of an embedded local Ray (CPU slots when there is no GPU);
            default: the machine's CPU count. Ignored when attaching.
        address: attach to this Ray cluster ("auto" or host:port); default: $RAY_ADDRESS if set,
            else start an embedded local Ray.
        threads_per_worker: torch threads in each worker process (keep cores x 1 >= workers).
        max_colocate: how many separate worker processes may share one device of a pool.
        """
        self.threads_per_worker = threads_per_worker
        self.max_colocate = max_colocate
        self.pools: dict[str, ResourcePool] = {}
        self.groups: dict[str, WorkerGroup] = {}
        self.records: list[CallRecord] = []
        address = address or os.environ.get("RAY_ADDRESS")
        env = {"env_vars": {**WORKER_ENV, **(runtime_env or {}).get("env_vars", {})}}
        runtime_env = {**(runtime_env or {}), **env}
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            if address:
                ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
            else:
                ray.init(
                    num_cpus=num_devices or os.cpu_count(),
                    include_dashboard=False,
                    runtime_env=runtime_env,
                )

    # ---- pools ---------------------------------------------------------------------------
    def pool(self, name: str, devices: int | list[int], max_colocate: int | None = None) -> ResourcePool:
        """Reserve devices: an int fills nodes in order, a list asks for that many devices on
        each of distinct nodes (e.g. [2, 2]). Re-creating a pool with the same name and shape
        returns it; a new shape replaces it (and the groups on it)."""
        old = self.pools.get(name)
        if old is not None:
            same = sum(old.devices_per_node) == devices if isinstance(devices, int) else old.devices_per_node == devices
            if same and old.placement is not None:
                return old
            self._drop_pool(name)
        reserved: dict[str, float] = {}
        for p in self.pools.values():
            for node in p.node_ids:
                reserved[node] = reserved.get(node, 0.0) + 1.0
        pool = ResourcePool.reserve(name, devices, reserved, max_colocate or self.max_colocate)
        self.pools[name] = pool
        return pool

    def _drop_pool(self, name: str) -> None:
        for role, group in list(self.groups.items()):
            if group.pool.name == name:
                self._drop_group(role)
        self.pools.pop(name).release()

    # ---- groups ----------------------------------------------------------------------------
    def group(
        self, role: str, worker_cls: type, pool: ResourcePool | str, config: Any = None, mesh: Mesh | None = None
    ) -> WorkerGroup:
        """One worker of `worker_cls` per device of `pool`, called as `role`.

        mesh: its (pp, tp, dp) layout; default pure data parallelism over the pool."""
        return self.fused(pool, mesh=mesh, **{role: (worker_cls, config)})[role]

    def fused(
        self, pool: ResourcePool | str, mesh: Mesh | None = None, **roles: tuple[type, Any] | type
    ) -> dict[str, WorkerGroup]:
        """Several roles in one process per device (e.g. actor and reference), each its own group:

        groups = session.fused(pool, actor=(ActorWorker, cfg), reference=(RefWorker, cfg))
        """
        pool = self._pool(pool)
        mesh = mesh or Mesh.data_parallel(pool.world_size)
        specs = {role: spec if isinstance(spec, tuple) else (spec, None) for role, spec in roles.items()}
        for role, (cls, _) in specs.items():
            if not isinstance(cls, type):
                raise TypeError(f"role {role!r}: expected a Worker class, got {cls!r}")
        for role in specs:
            if role in self.groups:
                self._drop_group(role)
        hostset = HostSet(pool, mesh, self.threads_per_worker, specs)
        groups = {role: WorkerGroup(role, hostset, cls) for role, (cls, _) in specs.items()}
        self.groups.update(groups)
        return groups

    def _pool(self, pool: ResourcePool | str) -> ResourcePool:
        name = pool if isinstance(pool, str) else pool.name
        if name not in self.pools or self.pools[name].placement is None:
            raise DispatchError(f"no pool named {name!r} in this session; pools: {sorted(self.pools)}")
        return self.pools[name]

    def _drop_group(self, role: str) -> None:
        """Tear down the processes behind `role` (and any role fused with it)."""
        hostset = self.groups[role].hostset
        self.records += hostset.drain_records()
        hostset.shutdown()
        for name in hostset.roles:
            self.groups.pop(name, None)

    # ---- tracing and lifetime ----------------------------------------------------------------
    def trace(self, timeout: float = 10.0) -> list[CallRecord]:
        """Every call's span records so far, from every live worker, in start order. Workers
        answer beside the calls they are running, so this is cheap while work is in flight;
        all host sets are asked at once and given `timeout` seconds together."""
        hostsets = list({id(g.hostset): g.hostset for g in self.groups.values()}.values())
        for hostset in hostsets:
            hostset.request_records()
        deadline = time.monotonic() + timeout
        for hostset in hostsets:
            self.records += hostset.drain_records(max(0.0, deadline - time.monotonic()), request=False)
        self.records.sort(key=lambda r: r.start)
        return list(self.records)

    def save_trace(self, path: str | Path) -> Path:
        """Write a Chrome/Perfetto trace JSON of all calls so far."""
        return save_chrome_trace(self.trace(), path)

    def clear(self) -> None:
        """Tear down every group and pool but keep Ray running (start a fresh layout)."""
        for role in list(self.groups):
            if role in self.groups:
                self._drop_group(role)
        for name in list(self.pools):
            self.pools.pop(name).release()

    def shutdown(self) -> None:
        self.clear()
        if self.owns_ray and ray.is_initialized():
            ray.shutdown()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Session(pools={list(self.pools)}, groups={list(self.groups)})"
