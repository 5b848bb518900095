"""From a plan to real resources: one pool per colocated set, one layout per model.

    layouts = plan.to_pools(session)
    pool, mesh = layouts["critic"]
    critic = session.group("critic", CriticWorker, pool, config, mesh=mesh)

The planner itself stays free of Ray: this module only calls the session it is given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from workbench.controller.mesh import Mesh

if TYPE_CHECKING:
    from workbench.controller.resource_pool import ResourcePool
    from workbench.planner.plan import ModelAssignment, Plan
    from workbench.session import Session


class Layout(NamedTuple):
    pool: ResourcePool
    mesh: Mesh


def model_mesh(assignment: ModelAssignment) -> Mesh:
    """The controller Mesh of a planned model, with the actor's generation layout if any."""
    s, g = assignment.strategy, assignment.generation
    return Mesh(pp=s.pp, tp=s.tp, dp=s.dp, gen_pp=g.pp if g else None, gen_tp=g.tp if g else None)


def to_pools(plan: Plan, session: Session) -> dict[str, Layout]:
    """Reserve the plan's pools on `session` and return each model's (pool, mesh)."""
    layouts = {}
    for colocated in plan.sets:
        devices = list(colocated.devices_per_node)
        pool = session.pool(colocated.name, devices if len(devices) > 1 else devices[0])
        for model, assignment in colocated.assignments.items():
            layouts[model] = Layout(pool, model_mesh(assignment))
    return layouts
