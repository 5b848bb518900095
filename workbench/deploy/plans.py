"""From a HybridFlow plan (workbench.planner.plan) to real resources on a Session: one pool per
colocated set, one layout and group per model.

    groups = deploy_plan(plan, session, {"actor": (ActorRolloutRefWorker, actor_cfg), ...})
    ppo = PPO(Groups(**groups), PPOConfig())

or, to wire the groups by hand, `plan_pools(plan, session)` gives each model's (pool, mesh).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from workbench.deploy.groups import Placed, check_layouts, start_groups
from workbench.mesh import Mesh
from workbench.planner.errors import PlannerError
from workbench.planner.placement import ColocatedSet, ModelAssignment
from workbench.planner.plan import Plan
from workbench.planner.specs import FROZEN_KEEPS

if TYPE_CHECKING:
    from workbench.controller.resource_pool import ResourcePool
    from workbench.controller.worker_group import WorkerGroup
    from workbench.session import Session


class Layout(NamedTuple):
    pool: ResourcePool
    mesh: Mesh


def model_mesh(assignment: ModelAssignment) -> Mesh:
    """The controller Mesh of a planned model, with the actor's generation layout (and the
    transition method the plan costed) if any."""
    s, g, t = assignment.strategy, assignment.generation, assignment.transition
    return s.with_generation(g, t.method if t else "hybridflow") if g else s


def plan_pools(plan: Plan, session: Session) -> dict[str, Layout]:
    """Reserve one pool per colocated set of `plan` on `session`; returns {model: (pool, mesh)}
    ready for `session.group(model, WorkerClass, pool, config, mesh=mesh)`."""
    return _reserve(plan.sets, session)


def deploy_plan(plan: Plan, session: Session, workers: dict[str, tuple[type, Any]]) -> dict[str, WorkerGroup]:
    """Pools, layouts and worker groups of `plan` on `session`: `workers` maps each model to
    (Worker class, config); returns {model: WorkerGroup}. The frozen models' configs must keep
    no more device memory than the plan counted (`check_frozen_keeps`)."""
    check_frozen_keeps(plan.workload.frozen_keep, workers)
    return deploy_sets(plan.sets, session, workers)


def check_frozen_keeps(planned: str, workers: dict[str, tuple[type, Any]]) -> None:
    """A plan that counted frozen models kept `planned` (`Workload.frozen_keep`, which "auto"
    chose) fits only if their workers keep no more on the devices: refuse a reference
    (`ActorConfig.reference_keep`) or score model (`ScoreModelConfig.keep`) that would."""
    for model, (_, config) in workers.items():
        if getattr(config, "reference", False):
            field, keep = "ActorConfig.reference_keep", getattr(config, "reference_keep", "whole")
        elif hasattr(config, "keep"):
            field, keep = f"{type(config).__name__}.keep", config.keep
        else:
            continue
        if FROZEN_KEEPS.index(keep) < FROZEN_KEEPS.index(planned):  # listed by device memory, most first
            raise PlannerError(
                f"{model}: {field}={keep!r} keeps more device memory than the plan counted (frozen models "
                f"kept {planned!r}, Workload.frozen_keep); set {field}={planned!r}, or plan with "
                f"frozen_keep={keep!r}"
            )


def deploy_sets(
    sets: Sequence[ColocatedSet], session: Session, workers: dict[str, tuple[type, Any]]
) -> dict[str, WorkerGroup]:
    """Pools, layouts and worker groups for a plan's colocated sets; returns {model: WorkerGroup}.

    workers: model -> (Worker class, config) for every model of the plan. Models of one
    colocated set with the same (pp, tp, dp) share one process per device (`start_groups`); a
    different layout gets its own processes on the set's pool. Everything is checked before any
    pool is reserved: each config's `check_layout(mesh, model)` says whether its worker runs the
    planned layout (tensor parallelism needs backend="3d"; plan a Problem(..., max_tp=1,
    max_pp=1) otherwise).
    """
    models = [m for s in sets for m in s.models]
    missing, unknown = [m for m in models if m not in workers], [w for w in workers if w not in models]
    if missing or unknown:
        raise PlannerError(
            f"deploy needs a (Worker class, config) for each planned model {models}; "
            + (f"missing {missing}" if missing else f"not in the plan: {unknown}")
        )
    check_layouts(Placed(m, workers[m], None, model_mesh(a)) for s in sets for m, a in s.assignments.items())
    layouts = _reserve(sets, session)
    return start_groups(session, [Placed(m, workers[m], pool, mesh) for m, (pool, mesh) in layouts.items()])


def _reserve(sets: Sequence[ColocatedSet], session: Session) -> dict[str, Layout]:
    """One pool per colocated set, reserved in order; each model's (pool, mesh)."""
    layouts: dict[str, Layout] = {}
    for colocated in sets:
        devices = list(colocated.devices_per_node)
        pool = session.pool(colocated.name, devices if len(devices) > 1 else devices[0])
        layouts |= {m: Layout(pool, model_mesh(a)) for m, a in colocated.assignments.items()}
    return layouts
