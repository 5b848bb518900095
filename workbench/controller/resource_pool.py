"""ResourcePool: a named set of devices, reserved as one Ray placement group.

A device is a GPU when the cluster has GPUs, otherwise one CPU slot (Ray logical CPUs, so a
2-core machine can still offer 4-8 "devices" to tests). Each device is one bundle, pinned to a
node with a label selector, so bundle i is rank i's device and ranks are ordered node by node.

Groups created on the same pool are colocated: they share the devices (each worker takes
1/max_colocate of its device) and their calls run one after another in the order issued.
Groups on disjoint pools run concurrently.

A slice (`pool.slice(name, first, size)`) is a pool of some of another pool's devices: the same
placement group, some of its bundles. Per-call plans (ReaLHF) put calls on meshes that share
some devices but not all, e.g. the actor's training on d0-3 and the reference on d0-1: one pool
spans them and each mesh is a slice of it. Calls are ordered per device, so a call on a slice
waits for the last call of another group on any of its devices, and calls on disjoint slices of
one pool run concurrently.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workbench import checks
from workbench.errors import PlacementError


def device_resource() -> str:
    """'GPU' when the cluster has any, else 'CPU'."""
    return "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else "CPU"


@dataclass
class NodeInfo:
    node_id: str
    address: str
    capacity: float


def alive_nodes(resource: str) -> list[NodeInfo]:
    nodes = [
        NodeInfo(n["NodeID"], n["NodeManagerAddress"], n["Resources"].get(resource, 0.0))
        for n in ray.nodes()
        if n["Alive"]
    ]
    # The head first, then by node id: a stable order for the same cluster.
    head = [n for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]]
    head_id = head[0]["NodeID"] if head else None
    return sorted(nodes, key=lambda n: (n.node_id != head_id, n.node_id))


@dataclass
class ResourcePool:
    """Devices for one or more worker groups. Create it with `Session.pool(...)`."""

    name: str
    devices_per_node: list[int]
    resource: str
    max_colocate: int
    node_ids: list[str] = field(default_factory=list)
    """The node of every device, in rank order."""
    placement: PlacementGroup | None = None
    bundles: tuple[int, ...] = ()
    """The placement group's bundle of each rank (a slice's are some of its parent's); () for
    0, 1, ... world_size - 1."""
    parent: str | None = None
    """The pool this one is a slice of."""
    hosts: tuple[str, ...] = ()
    """The nodes it was asked to be on (addresses or node ids); () for any."""
    last_calls: dict[int, tuple] = field(default_factory=dict)
    """Bundle -> (host set, object refs) of the last call issued on that device, shared with
    the pool's slices: a call by another host set waits for those refs first (time-sharing in
    issue order). The host set is None after joint calls of several (`joint_calls`): every
    group waits for them."""
    parked: list[tuple[int, tuple, ray.actor.ActorHandle]] = field(default_factory=list)
    """Warm processes on this placement group, shared with its slices: (bundle, key, host) of
    each kept from a removed group (`Session(keep_processes=True)`), for a group of the same
    key (its roles' classes, threads, backend) to take instead of starting new ones."""

    @property
    def world_size(self) -> int:
        return sum(self.devices_per_node)

    @property
    def devices(self) -> tuple[int, ...]:
        """The placement group bundles (devices) of ranks 0, 1, ..."""
        return self.bundles or tuple(range(self.world_size))

    def has_shape(self, devices: int | list[int], max_colocate: int, hosts: tuple[str, ...] = ()) -> bool:
        """Whether Session.pool(name, devices, max_colocate, hosts) asks for this pool's shape."""
        count = sum(self.devices_per_node) == devices if isinstance(devices, int) else self.devices_per_node == devices
        return count and self.max_colocate == max_colocate and self.hosts == tuple(hosts)

    def lost_nodes(self) -> dict[str, str]:
        """{node id: address} of this pool's nodes that are no longer alive (a host that died
        or dropped off the network)."""
        nodes = {n["NodeID"]: n for n in ray.nodes()}
        return {
            node: nodes.get(node, {}).get("NodeManagerAddress", "?")
            for node in dict.fromkeys(self.node_ids)
            if not nodes.get(node, {}).get("Alive", False)
        }

    def slice(self, name: str, first: int, size: int) -> ResourcePool:
        """A pool of devices [first, first + size) of this one (its ranks' order), sharing its
        placement group and its per-device call order. Create slices with `Session.slice`."""
        if not (checks.is_whole(first, 0) and checks.is_whole(size, 1) and first + size <= self.world_size):
            raise PlacementError(
                f"slice {name!r} of pool {self.name!r}: devices [{first}, {first}+{size}) are not within its "
                f"{self.world_size} device(s); give 0 <= first and first + size <= {self.world_size}, size >= 1"
            )
        nodes = self.node_ids[first : first + size]
        return dataclasses.replace(  # the same placement group and per-device call order
            self,
            name=name,
            devices_per_node=[nodes.count(n) for n in dict.fromkeys(nodes)],
            node_ids=nodes,
            bundles=self.devices[first : first + size],
            parent=self.name,
        )

    def shares_devices(self, other: ResourcePool) -> bool:
        """Whether some device of this pool is one of `other`'s (a slice and its parent, two
        overlapping slices, or the same pool)."""
        if self.placement is None or self.placement is not other.placement:
            return self.name == other.name
        return not set(self.devices).isdisjoint(other.devices)

    @classmethod
    def plan(
        cls, name: str, devices: int | list[int], exclude: PlacementGroup | None = None, hosts: tuple[str, ...] = ()
    ) -> list[str]:
        """The node of each device the pool would get now, counting every live placement
        group on the cluster as taken except `exclude` (a pool about to be replaced), on
        `hosts` only when given. Raises PlacementError, having touched nothing, when they are
        not free."""
        devices = check_devices(name, devices)
        resource = device_resource()
        nodes = on_hosts(name, devices, alive_nodes(resource), hosts)
        return _choose_nodes(name, devices, nodes, reserved_per_node(resource, exclude), resource)

    @classmethod
    def reserve(
        cls,
        name: str,
        devices: int | list[int],
        label: str,
        max_colocate: int = 4,
        timeout: float = 30.0,
        exclude: PlacementGroup | None = None,
        hosts: tuple[str, ...] = (),
    ) -> ResourcePool:
        """Reserve devices now as a placement group named `label` (unique per session and
        pool version, so re-runs and other drivers never collide)."""
        resource = device_resource()
        node_ids = cls.plan(name, devices, exclude, hosts)
        counts = [node_ids.count(n) for n in dict.fromkeys(node_ids)]
        bundle = {resource: 1.0} if resource == "CPU" else {resource: 1.0, "CPU": 1.0}
        pg = placement_group(
            [dict(bundle) for _ in node_ids],
            strategy="PACK",
            name=label,
            bundle_label_selector=[{"ray.io/node-id": n} for n in node_ids],
        )
        try:
            ray.get(pg.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(pg)
            raise PlacementError(
                f"pool {name!r}: could not reserve {len(node_ids)} {resource} device(s) within "
                f"{timeout:.0f} s; they exist but are held by something outside this session "
                f"(another driver or placement group). Free them or ask for fewer devices."
            ) from None
        return cls(name, counts, resource, max_colocate, node_ids, pg, hosts=tuple(hosts))

    def scheduling(self, rank: int) -> dict:
        """ray.remote options placing rank's worker on its device."""
        if self.placement is None:
            raise PlacementError(f"pool {self.name!r} was released; create it again before placing workers on it")
        share = 1.0 / self.max_colocate
        bundle = self.devices[rank]
        options = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                self.placement, placement_group_bundle_index=bundle
            ),
            "num_cpus": share,
        }
        if self.resource == "GPU":
            options["num_gpus"] = share
        return options

    def unpark(self, bundle: int, key: tuple) -> ray.actor.ActorHandle | None:
        """A warm process of `key` on `bundle`, taken off the parked list; None when there is none."""
        for i, (b, k, host) in enumerate(self.parked):
            if b == bundle and k == key:
                del self.parked[i]
                return host
        return None

    def evict(self, keep: tuple | None = None) -> None:
        """Stop the parked processes (those of another key than `keep`): their share of the
        devices goes back to the pool, for new processes."""
        for _, key, host in self.parked:
            if key != keep:
                ray.kill(host, no_restart=True)
        self.parked[:] = [p for p in self.parked if p[1] == keep]

    def release(self) -> None:
        """Give the devices back (a slice only forgets them: its parent holds them)."""
        if self.placement is not None and self.parent is None:
            remove_placement_group(self.placement)
        self.placement = None

    def __repr__(self) -> str:
        within = f", slice {list(self.devices)} of {self.parent!r}" if self.parent else ""
        return f"ResourcePool({self.name!r}, devices_per_node={self.devices_per_node}, {self.resource}{within})"


def reserved_per_node(resource: str, exclude: PlacementGroup | None = None) -> dict[str, float]:
    """Devices held per node by every live placement group (this driver's and others')."""
    skip = exclude.id.hex() if exclude is not None else None
    held: dict[str, float] = {}
    for pg_id, info in ray.util.placement_group_table().items():
        if pg_id == skip or info.get("state") == "REMOVED":
            continue
        for index, node in (info.get("bundles_to_node_id") or {}).items():
            held[node] = held.get(node, 0.0) + info["bundles"][index].get(resource, 0.0)
    return held


def check_devices(name: str, devices) -> int | list[int]:
    """devices as given, if it is a positive int or a non-empty list of them; else a PlacementError."""
    if checks.is_whole(devices, 1) or (
        isinstance(devices, (list, tuple)) and devices and all(checks.is_whole(d, 1) for d in devices)
    ):
        return devices if isinstance(devices, int) else list(devices)
    raise PlacementError(
        f"pool {name!r}: devices={devices!r} is not a device count; pass a whole number >= 1 "
        f"(e.g. 2: fill nodes in order) or a list of them, one per node (e.g. [2, 2])"
    )


LOST_HOST = {
    "remaining": "reserve the pool again on the cluster's remaining capacity",
    "rejoin": "wait for the lost hosts to be back, and reserve the pool on them again",
}
"""What recovering a group does when a host of its pool is gone (Session.recover)."""


def wait_for_hosts(name: str, hosts: tuple[str, ...], wait: float) -> None:
    """Until every host (address or node id) is an alive node, or a PlacementError at `wait`."""
    deadline = time.monotonic() + wait
    while True:
        alive = {v for n in ray.nodes() if n["Alive"] for v in (n["NodeID"], n["NodeManagerAddress"])}
        missing = [h for h in hosts if h not in alive]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise PlacementError(
                f"pool {name!r}: host(s) {missing} did not come back within {wait:g} s. Start Ray on "
                f"them again (ray start --address=...), or recover with lost_host='remaining'"
            )
        time.sleep(0.5)


def check_hosts(name: str, devices: int | list[int], hosts) -> tuple[str, ...]:
    """`hosts` as a tuple, checked against the cluster's alive nodes (PlacementError naming
    them): a list or tuple of node addresses or ids, distinct, one per entry of a device list."""
    if not (isinstance(hosts, (list, tuple)) and all(isinstance(h, str) and h for h in hosts)):
        raise PlacementError(f"pool {name!r}: hosts={hosts!r}; give a list of node addresses or node ids")
    if hosts:
        on_hosts(name, check_devices(name, devices), alive_nodes(device_resource()), tuple(hosts))
    return tuple(hosts)


def on_hosts(name: str, devices: int | list[int], nodes: list[NodeInfo], hosts: tuple[str, ...]) -> list[NodeInfo]:
    """The nodes a pool may use, in the order asked: all of them when `hosts` is empty, else
    each host named (a node's address or id), which must be alive; a list of devices per node
    takes one host per entry."""
    if not hosts:
        return nodes
    known = {n.address: n for n in nodes} | {n.node_id: n for n in nodes}  # (their form: check_hosts)
    missing = [h for h in hosts if h not in known]
    if missing:
        alive = ", ".join(f"{n.address} ({n.node_id[:8]})" for n in nodes)
        raise PlacementError(
            f"pool {name!r}: hosts {missing} are not alive nodes of this cluster; its alive nodes: {alive}. "
            f"Name each host by its address or node id"
        )
    chosen = list({known[h].node_id: known[h] for h in hosts}.values())
    if len(chosen) < len(hosts) or (isinstance(devices, list) and len(devices) != len(hosts)):
        raise PlacementError(
            f"pool {name!r}: hosts={list(hosts)} must name distinct nodes"
            + (f", one per entry of devices={devices}" if isinstance(devices, list) else "")
        )
    return chosen


def _choose_nodes(
    name: str, devices: int | list[int], nodes: list[NodeInfo], reserved: dict[str, float], resource: str
) -> list[str]:
    """The node of each device: a list asks for that many devices on distinct nodes, an int
    fills nodes in order using as few as possible."""
    free = {n.node_id: n.capacity - reserved.get(n.node_id, 0.0) for n in nodes}
    summary = ", ".join(f"{n.address}/{n.node_id[:8]}: {free[n.node_id]:g} free of {n.capacity:g}" for n in nodes)
    total_free = sum(max(0.0, v) for v in free.values())
    if isinstance(devices, int):
        if devices < 1:
            raise PlacementError(f"pool {name!r}: needs at least 1 device, got {devices}")
        if devices > total_free:
            raise PlacementError(
                f"pool {name!r} asks for {devices} {resource} device(s) but the cluster has "
                f"{total_free:g} free ({summary}). Ask for fewer, release a pool, or start the "
                f"session with more devices (Session(num_devices=...))."
            )
        chosen: list[str] = []
        for n in nodes:
            take = min(int(free[n.node_id]), devices - len(chosen))
            chosen += [n.node_id] * max(0, take)
        return chosen
    if not devices or any(d < 1 for d in devices):
        raise PlacementError(f"pool {name!r}: devices_per_node must be positive counts, got {devices}")
    if len(devices) > len(nodes):
        raise PlacementError(
            f"pool {name!r} asks for devices on {len(devices)} nodes but the cluster has "
            f"{len(nodes)} alive node(s) ({summary})."
        )
    chosen = []
    remaining = dict(free)
    for want in devices:
        fits = [n for n in nodes if remaining[n.node_id] >= want and n.node_id not in chosen]
        if not fits:
            raise PlacementError(
                f"pool {name!r} asks for devices_per_node={devices}; no free node has {want} "
                f"{resource} device(s) left ({summary})."
            )
        chosen.append(fits[0].node_id)
        remaining[fits[0].node_id] -= want
    return [node for node, want in zip(chosen, devices) for _ in range(want)]
