"""What both kinds of plan do last: check each worker config against its planned layout, then
start the groups, roles that share a pool and a (pp, tp, dp) layout in one process per device."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from workbench.mesh import Mesh

if TYPE_CHECKING:
    from workbench.controller.resource_pool import ResourcePool
    from workbench.session import Session


class Placed(NamedTuple):
    """One role of a plan: its (Worker class, config), pool and layout."""

    role: str
    worker: tuple[type, Any]
    pool: ResourcePool | None  # None until its pool is reserved
    layout: Mesh


def check_layouts(placed: Iterable[Placed]) -> None:
    """Each config's `check_layout(layout, role)` (whether its worker runs the planned layout),
    before any pool is reserved."""
    for p in placed:
        check = getattr(p.worker[1], "check_layout", None)
        if check is not None:
            check(p.layout, p.role)


def start_groups(session: Session, placed: Iterable[Placed]) -> dict[str, Any]:
    """The worker groups, {role: group}: roles on one pool with the same (pp, tp, dp) share one
    process per device (`session.fused`, as HybridFlow colocates actor and reference)."""
    fused: dict[tuple[str, tuple[int, int, int]], list[Placed]] = {}
    pools: dict[tuple[str, tuple[int, int, int]], ResourcePool] = {}
    for p in placed:
        if p.pool is None:
            raise ValueError(f"start_groups: the pool of {p.role!r} is not reserved yet")
        key = (p.pool.name, (p.layout.pp, p.layout.tp, p.layout.dp))
        pools[key] = p.pool
        fused.setdefault(key, []).append(p)
    groups: dict[str, Any] = {}
    for key, here in fused.items():
        # The generation layout only matters to the role that generates; keep it if any.
        layout = max((p.layout for p in here), key=lambda x: x.gen_tp is not None)
        groups |= session.fused(pools[key], mesh=layout, **{p.role: p.worker for p in here})
    return groups
