"""The groups a per-call plan (ReaLHF's ExecutionPlan) needs: every call on its planned mesh.
`workbench.deploy.calls.deploy_calls` starts them on a Session.

One pool per set of overlapping device meshes, spanning them; a mesh that is not the whole span
is a slice of that pool (`Session.slice`: e.g. the reference on d0-1 while the actor trains on
d0-3), and calls on shared devices run in the order issued. Each model has a home group: its
train call's (mesh, layout), or a frozen model's first call's; every other (mesh, layout) its
calls use gets a replica group.
Models on the same (mesh, layout) share one process per device (`session.fused`), as
`deploy.deploy_sets` does. What this runtime does with a call away from its model's home:

  * the actor's generation on its own devices in another layout: the 3D-HybridEngine's
    generation layout (the home group's `Mesh.with_generation`);
  * the actor's generation on other devices (apart from its home's, or some of them): a
    generate-only rollout group (`Groups.rollout`), which the algorithm brings up to date after
    each update (RolloutLink);
  * another call of a trained model elsewhere (the critic's values on other devices, or on its
    own in another layout): a replica that a CallRouter (workbench.deploy.routing) sends the
    call to, brought up to date through a weight channel before a call that would read older
    weights (held as FSDP shards, whatever backend the home trains in, or in a tensor-parallel
    layout as pieces of a "3d" engine): reallocated into from every rank of the home, a layer
    unit at a time (gathered from FSDP shards, or from a tensor-parallel home's own pieces), else
    (a pipeline-parallel or DeepSpeed home; data-parallel copies only) broadcast from its rank 0;
  * a frozen model's call elsewhere: a replica with the same weights, never pushed.
A copy on devices its home holds (generation on d0-1 while the actor trains on d0, or values in
p1t1d2 beside a p1t2d1 home) takes its turns there like any other group; the push's two calls
run as joint calls, over gloo. Such a copy holds its own weights beside the home's: the runtime
does not yet reallocate a model's weights between layouts inside its own processes, except the
hybrid engine's switch.

Refused, on the driver before any pool is reserved: the actor's log-probs away from its
training (a replica would need a trainer's forward), a trained model's copy in a
pipeline-parallel layout, a tensor-parallel one for generation or of a DeepSpeed or
pipeline-parallel home, and two calls running one worker method on different placements (a
handle routes by method)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from workbench import steps
from workbench.errors import ConfigError
from workbench.mesh import Mesh
from workbench.planner.dataflow import Dataflow
from workbench.planner.errors import PlannerError
from workbench.planner.execution import DeviceRange, ExecutionPlan
from workbench.planner.strategy import is_generation_layout

ROLLOUT = "rollout"
"""The role of the actor's generation group on other devices (algorithms.Groups.rollout)."""
PUSHED_METHODS = ("compute_values",)
"""Methods a replica of a trained model runs on weights pushed from its home (the workers that
offer send/receive_weights: CriticWorker)."""


@dataclass
class GroupSpec:
    """One worker group a per-call plan starts."""

    role: str
    """Its name in the session: the model's for a home group, its own for a replica."""
    model: str
    mesh: DeviceRange
    layout: Mesh
    worker: tuple[type, Any]
    calls: list[str] = field(default_factory=list)
    home: str | None = None
    """For a replica: the home group's role."""


def _layout_key(layout: Mesh) -> tuple[int, int, int]:
    return (layout.pp, layout.tp, layout.dp)


def _where(mesh: DeviceRange, layout: Mesh) -> str:
    return f"{mesh}:{layout.short()}"


def check_calls(plan: ExecutionPlan, dataflow: Dataflow, workers: dict[str, Any]) -> None:
    """The plan covers exactly the dataflow's calls and `workers` exactly its models."""
    names = [c.name for c in dataflow.calls]
    unknown = [c for c in plan.layouts if c not in names]
    if unknown:
        raise PlannerError(
            f"the plan places call(s) {unknown} that dataflow {dataflow.name!r} does not have; its calls: {names}"
        )
    missing = [c for c in names if c not in plan.layouts]
    if missing:
        raise PlannerError(f"the plan gives no (mesh, layout) to call(s) {missing} of dataflow {dataflow.name!r}")
    models = list(dataflow.models)
    absent, extra = [m for m in models if m not in workers], [w for w in workers if w not in models]
    if absent or extra:
        raise PlannerError(
            f"deploy needs a (Worker class, config) for each model of dataflow {dataflow.name!r} {models}; "
            + (f"missing {absent}" if absent else f"not in the dataflow: {extra}")
        )


def spans(meshes: Iterable[DeviceRange]) -> dict[DeviceRange, DeviceRange]:
    """Each mesh's span: the smallest mesh covering every mesh it overlaps, directly or through
    others (one pool each; the meshes inside are its slices)."""
    out: dict[DeviceRange, DeviceRange] = {}
    group: list[DeviceRange] = []
    end = 0
    for mesh in sorted(set(meshes)) + [None]:
        if group and (mesh is None or mesh.first >= end):  # past every mesh so far: the span ends
            out |= dict.fromkeys(group, DeviceRange(group[0].first, end - group[0].first))
            group = []
        if mesh is not None:
            group.append(mesh)
            end = max(end, mesh.first + mesh.size)
    return out


def plan_groups(plan: ExecutionPlan, dataflow: Dataflow, workers: dict[str, tuple[type, Any]]) -> list[GroupSpec]:
    """The groups a per-call plan needs, checked (no session, no Ray): home groups first."""
    check_calls(plan, dataflow, workers)
    specs: list[GroupSpec] = []
    for model in dataflow.models:
        calls = dataflow.calls_of(model)
        trained = next((c for c in calls if c.kind == "train"), None)
        home_call = trained or calls[0]
        home_mesh, home_layout = plan.layouts[home_call.name]
        home = GroupSpec(model, model, home_mesh, home_layout, workers[model])
        replicas: dict[tuple[DeviceRange, tuple[int, int, int]], GroupSpec] = {}
        routed: dict[str, tuple[DeviceRange, Mesh, str]] = {}  # worker method -> where, which call
        for call in calls:
            mesh, layout = plan.layouts[call.name]
            method = worker_method(call.name, model)
            if method in routed and routed[method][:2] != (mesh, layout):
                other_mesh, other_layout, other = routed[method]
                raise PlannerError(
                    f"calls {other!r} ({_where(other_mesh, other_layout)}) and {call.name!r} "
                    f"({_where(mesh, layout)}) of model {model!r} both run {method}, and a handle routes "
                    f"by method: give them the same mesh and layout"
                )
            routed[method] = (mesh, layout, call.name)
            if (mesh, _layout_key(layout)) == (home_mesh, _layout_key(home_layout)):
                home.calls.append(call.name)
            elif mesh == home_mesh and _hybrid_engine(call, home, layout, trained is not None):
                if home_layout.pp > 1 and (layout.pp, layout.tp) != (1, 1) and layout.pp != home_layout.pp:
                    raise PlannerError(
                        f"call {call.name!r} of model {model!r} ({_where(mesh, layout)}): pipeline stages "
                        f"generate in pipeline stages of their own ({home_layout.short()} or p{home_layout.pp} "
                        f"with a smaller tp) or with whole weights on every device (p1t1d{layout.world_size}); "
                        f"give the call one of those"
                    )
                home.layout = home.layout.with_generation(layout, "hybridflow")
                home.calls.append(call.name)
            else:  # a copy in the call's layout, on other devices or on the home's own
                key = (mesh, _layout_key(layout))
                replica = _replica(model, call, mesh, layout, workers[model], trained is not None, home_layout)
                if mesh == home_mesh and replica.role != ROLLOUT:  # beside the home: named by its layout too
                    replica.role += f"_{layout.short()}"
                replicas.setdefault(key, replica).calls.append(call.name)
        if any(r.role == ROLLOUT for r in replicas.values()):  # the home no longer generates
            home.worker = (home.worker[0], _replace(home.worker[1], rollout=None))
        specs.append(home)
        specs += replicas.values()
    roles = [s.role for s in specs]
    if len(set(roles)) != len(roles):
        raise PlannerError(f"the plan needs groups {roles}; a role name repeats (one generation group at most)")
    return specs


def worker_method(call: str, model: str) -> str:
    step = steps.BY_NAME.get(call)
    if step is None or step.worker_method is None:
        raise PlannerError(
            f"call {call!r} of model {model!r} is not a worker step of workbench.steps, so no worker method "
            f"is known to route it; name the call after its step (derive_dataflow does)"
        )
    return step.worker_method


def _hybrid_engine(call, home: GroupSpec, layout: Mesh, trained: bool) -> bool:
    """Whether the home itself generates in `layout` on its devices (the 3D-HybridEngine: the
    trained actor, a layout of the same pp and tp or divisors of them, none chosen yet)."""
    return call.kind == "generate" and trained and is_generation_layout(home.layout, layout) and not home.layout.gen_tp


def _replica(
    model: str, call, mesh: DeviceRange, layout: Mesh, worker: tuple[type, Any], trained: bool, home_layout: Mesh
):
    """The group that runs `call` of `model` away from its home (in `home_layout`): on other
    devices (some may be the home's), or on the home's own in another layout. Checks the call."""
    cls, config = worker
    where = f"call {call.name!r} of model {model!r} on {mesh} ({layout.short()})"
    if not trained:
        return GroupSpec(f"{model}_{mesh}", model, mesh, layout, worker, home=model)
    if call.kind == "generate":
        if config is not None and not (hasattr(config, "train") and hasattr(config, "rollout")):
            raise PlannerError(f"{where}: generation apart from training needs an ActorRolloutRefWorker config")
        if layout.tp > 1 or layout.pp > 1:
            raise PlannerError(
                f"{where}: a rollout group apart from the hybrid engine takes whole weights; give it data "
                f"parallelism only (p1t1d{layout.world_size})"
            )
        rollout = _replace(config, train=False, reference=False)
        return GroupSpec(ROLLOUT, model, mesh, layout, (cls, rollout), home=model)
    method = worker_method(call.name, model)
    if method not in PUSHED_METHODS:
        raise PlannerError(
            f"{where}: {method} of a trained model runs where it trains (a replica holds no trainer to run it); "
            f"only {list(PUSHED_METHODS)} run on replicas so far. Put the call on {model!r}'s training mesh"
        )
    if layout.pp > 1:
        raise PlannerError(
            f"{where}: a replica takes whole or tensor-parallel weights; give it pp=1 (p1t{layout.tp}d{layout.dp})"
        )
    if config is not None and getattr(config, "lora", None) is not None:
        raise PlannerError(f"{where}: a replica loads whole pushed weights, not LoRA adapters; use lora=None")
    if layout.tp > 1:
        # Only a reallocation fills tensor-parallel pieces: from an FSDP or tensor-parallel home.
        if home_layout.pp > 1 or (config is not None and getattr(config, "backend", None) not in ("fsdp", "3d")):
            raise PlannerError(
                f"{where}: a tensor-parallel replica is reallocated into from an FSDP or tensor-parallel "
                f"home (pp=1); train {model!r} with backend 'fsdp' or '3d' and pp=1, or give the replica "
                f"p1t1d{layout.world_size}"
            )
        try:  # the replica only computes: the home's kept-forward option is the update's
            worker = (cls, _replace(config, backend="3d", reuse_values_forward=False))
        except ConfigError as refused:
            raise PlannerError(
                f"{where}: a tensor-parallel replica runs backend '3d', which refuses: {refused}"
            ) from refused
    elif config is not None and getattr(config, "backend", None) != "fsdp":
        # The home trains tensor- or pipeline-parallel; the replica only computes, so it holds
        # the pushed weights as FSDP shards whatever the home's backend.
        worker = (cls, _replace(config, backend="fsdp"))
    return GroupSpec(f"{model}_{mesh}", model, mesh, layout, worker, home=model)


def _replace(config: Any, **changes: Any) -> Any:
    # A config is a dataclass instance (or anything else, kept); never a dataclass class.
    is_instance = dataclasses.is_dataclass(config) and not isinstance(config, type)
    return dataclasses.replace(config, **changes) if is_instance else config


def runtime_refusal(plan: ExecutionPlan, dataflow: Dataflow) -> str | None:
    """Why this runtime cannot run `plan` whatever the workers' configs (None: it can): the
    placement rules `deploy_calls` checks, for a search to keep to runnable plans."""
    try:
        plan_groups(plan, dataflow, {m: (object, None) for m in dataflow.models})
    except PlannerError as refusal:
        return str(refusal)
    return None
