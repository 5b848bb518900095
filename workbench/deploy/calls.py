"""From a per-call plan (ReaLHF's ExecutionPlan) to real resources on a Session: every call on
its planned mesh, by the rules of `workbench.planner.call_groups`.

    handles = deploy_calls(plan, session, {"actor": (ActorRolloutRefWorker, actor_cfg), ...}, dataflow)
    ppo = PPO(Groups(**handles), PPOConfig())
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from workbench.deploy.routing import CallRouter
from workbench.planner.call_groups import ROLLOUT, GroupSpec, layout_key, plan_groups, spans, worker_method
from workbench.planner.dataflow import Dataflow
from workbench.planner.execution import DeviceRange, ExecutionPlan

if TYPE_CHECKING:
    from workbench.session import Session


def deploy_calls(
    plan: ExecutionPlan, session: Session, workers: dict[str, tuple[type, Any]], dataflow: Dataflow
) -> dict[str, Any]:
    """Start what `plan` needs on `session`; returns a handle per model (its home group, or a
    CallRouter when some of its calls run on replicas) and `rollout` when the actor generates on
    devices of its own. Everything is checked before the first pool is reserved."""
    specs = plan_groups(plan, dataflow, workers)
    for spec in specs:
        check: Callable | None = getattr(spec.worker[1], "check_layout", None)
        if check is not None:
            check(spec.layout, spec.role)
    span_of = spans(s.mesh for s in specs)
    pools = {span: session.pool(f"calls_{span}", span.size) for span in sorted(set(span_of.values()))}
    for mesh, span in span_of.items():
        if mesh != span:
            pools[mesh] = session.slice(f"calls_{mesh}", pools[span], mesh.first - span.first, mesh.size)
    fused: dict[tuple[DeviceRange, tuple[int, int, int]], list[GroupSpec]] = {}
    for spec in specs:
        fused.setdefault((spec.mesh, layout_key(spec.layout)), []).append(spec)
    groups: dict[str, Any] = {}
    for (mesh, _), here in fused.items():
        # The generation layout only matters to the model that generates; keep it if any.
        layout = max((s.layout for s in here), key=lambda x: x.gen_tp is not None)
        groups |= session.fused(pools[mesh], mesh=layout, **{s.role: s.worker for s in here})
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
