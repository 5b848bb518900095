"""ClusterView: what the session holds, machine by machine.

    ClusterView(session)       # nodes, pools, groups, roles, ranks, layouts, memory per worker

Read from the session's own registry and Ray's actor table; nothing is asked of the workers,
so it answers while they compute. Memory is each worker process's resident set, read on this
machine (workers on other machines show their node but no memory).
"""

from __future__ import annotations

import psutil
import ray

from widgets.ui import Control, View, escape

MIB = 1024**2


def _actor_info(actor_id: str) -> dict:
    try:
        return ray._private.state.actors(actor_id=actor_id) or {}
    except Exception:  # Ray shut down, or the actor is gone
        return {}


class ClusterView(View):
    """A table of the session's workers; `data()` gives the same as plain Python."""

    has_figure = False

    def __init__(self, session):
        super().__init__()
        self.session = session

    def controls(self) -> list[Control]:
        return []

    def set(self, **values) -> None:
        self.changed()

    def refresh(self) -> None:
        self.changed()

    def data(self) -> dict:
        """nodes, pools (devices per node), and one row per worker process: pool, roles, rank,
        (pp, tp, dp) coordinate, node, pid, resident memory."""
        nodes = (
            [
                {
                    "node": n["NodeID"],
                    "address": n.get("NodeManagerAddress"),
                    "alive": n.get("Alive", False),
                    "cpus": n.get("Resources", {}).get("CPU", 0),
                    "gpus": n.get("Resources", {}).get("GPU", 0),
                }
                for n in ray.nodes()
            ]
            if ray.is_initialized()
            else []
        )
        pools = [
            {
                "pool": p.name,
                "devices_per_node": list(p.devices_per_node),
                "resource": p.resource,
                "slice_of": p.parent,
                "devices": list(p.devices),
            }
            for p in self.session.pools.values()
        ]
        workers, seen = [], set()
        for group in self.session.groups.values():
            hostset = group.hostset
            if id(hostset) in seen:
                continue
            seen.add(id(hostset))
            mesh = hostset.mesh
            for rank, host in enumerate(hostset.hosts):
                info = _actor_info(host._actor_id.hex())
                pid = info.get("Pid")
                node = (info.get("Address") or {}).get("NodeID")
                rss = None
                if pid:
                    try:
                        rss = psutil.Process(pid).memory_info().rss
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        rss = None
                coord = mesh.coord(rank)
                workers.append(
                    {
                        "pool": hostset.pool.name,
                        "roles": list(hostset.roles),
                        "rank": rank,
                        "layout": f"pp{mesh.pp} tp{mesh.tp} dp{mesh.dp}",
                        "coord": tuple(coord),
                        "node": node,
                        "pid": pid,
                        "state": info.get("State"),
                        "memory_mib": rss / MIB if rss is not None else None,
                    }
                )
        return {"nodes": nodes, "pools": pools, "workers": workers}

    def summary(self) -> str:
        d = self.data()
        nodes = ", ".join(f"{n['node'][:8]} ({n['cpus']:g} CPU, {n['gpus']:g} GPU)" for n in d["nodes"])
        pools = (
            ", ".join(
                f"{p['pool']} {p['devices_per_node']}"
                + (f" (devices {p['devices']} of {p['slice_of']})" if p["slice_of"] else "")
                for p in d["pools"]
            )
            or "none"
        )
        rows = []
        for w in d["workers"]:
            memory = "" if w["memory_mib"] is None else f"{w['memory_mib']:.0f} MiB"
            rows.append(
                f"<tr><td>{escape(w['pool'])}</td><td>{escape('+'.join(w['roles']))}</td><td>{w['rank']}</td>"
                f"<td>{escape(w['layout'])} at {escape(w['coord'])}</td><td>{escape((w['node'] or '?')[:8])}</td>"
                f"<td>{w['pid']}</td><td>{memory}</td></tr>"
            )
        rows = "".join(rows)
        return (
            f"<div><b>nodes</b>: {escape(nodes)}<br><b>pools</b>: {escape(pools)}</div>"
            "<table><tr><th>pool</th><th>roles</th><th>rank</th><th>layout (pp, tp, dp)</th><th>node</th>"
            f"<th>pid</th><th>memory</th></tr>{rows}</table>"
        )
