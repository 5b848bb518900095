"""From a per-call plan (ReaLHF's ExecutionPlan) to real resources on a Session: every call on
its planned mesh, by the rules of `workbench.planner.call_groups`.

    handles = deploy_calls(plan, session, {"actor": (ActorRolloutRefWorker, actor_cfg), ...}, dataflow)
    ppo = PPO(Groups(**handles), PPOConfig())
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from workbench.deploy.groups import Placed, check_layouts, start_groups
from workbench.deploy.routing import CallRouter
from workbench.planner.call_groups import ROLLOUT, plan_groups, spans, worker_method
from workbench.planner.dataflow import Dataflow
from workbench.planner.execution import ExecutionPlan

if TYPE_CHECKING:
    from workbench.session import Session


def deploy_calls(
    plan: ExecutionPlan, session: Session, workers: dict[str, tuple[type, Any]], dataflow: Dataflow
) -> dict[str, Any]:
    """Start what `plan` needs on `session`; returns a handle per model (its home group, or a
    CallRouter when some of its calls run on replicas) and `rollout` when the actor generates on
    devices of its own. Everything is checked before the first pool is reserved."""
    specs = plan_groups(plan, dataflow, workers)
    check_layouts(Placed(s.role, s.worker, None, s.layout) for s in specs)
    span_of = spans(s.mesh for s in specs)
    pools = {span: session.pool(f"calls_{span}", span.size) for span in sorted(set(span_of.values()))}
    for mesh, span in span_of.items():
        if mesh != span:
            pools[mesh] = session.slice(f"calls_{mesh}", pools[span], mesh.first - span.first, mesh.size)
    groups = start_groups(session, [Placed(s.role, s.worker, pools[s.mesh], s.layout) for s in specs])
    handles: dict[str, Any] = {}
    for model in dataflow.models:
        replicas = [s for s in specs if s.home == model and s.role != ROLLOUT]
        if not replicas:
            handles[model] = groups[model]
            continue
        trained = any(c.kind == "train" for c in dataflow.calls_of(model))
        routes = {worker_method(c, model): groups[s.role] for s in replicas for c in s.calls}
        train_method = next((worker_method(c.name, model) for c in dataflow.calls_of(model) if c.kind == "train"), None)
        handles[model] = CallRouter(model, groups[model], routes, train_method if trained else None)
    if ROLLOUT in groups:
        handles[ROLLOUT] = groups[ROLLOUT]
    return handles
