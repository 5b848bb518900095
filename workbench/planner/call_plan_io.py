"""A per-call plan (ExecutionPlan) as plain YAML values and back:

    calls:                                   # every call of the dataflow
      gen:          {devices: 1, first_device: 1}             # layout pp 1, tp 1, dp = devices
      values:       {devices: 1, first_device: 1}
      update_actor: {devices: 1, pp: 1, tp: 1, dp: 1}         # first_device 0 when not given
      ...

Read with the same checks `deploy_calls` makes (what runs away from a model's home:
`call_deploy.runtime_refusal`), each refusal a PlanFormatError naming the field."""

from __future__ import annotations

from typing import Any

from workbench.mesh import Mesh
from workbench.planner.call_groups import runtime_refusal
from workbench.planner.dataflow import Dataflow
from workbench.planner.execution import DeviceRange, ExecutionPlan, valid_meshes
from workbench.planner.plan_io import PlanFormatError
from workbench.planner.specs import ClusterSpec

CALL_KEYS = ("devices", "first_device", "pp", "tp", "dp")
PLAN_KEYS = ("name", "calls", "estimated_iteration_s", "estimated_call_s", "source", "cluster", "measured_iteration_s")
"""Besides `calls` (and `name`), what a run writes in its plan.yaml for the reader: ignored when read
back (the estimate is recomputed), so `placement.plan=<plan.yaml>` runs the plan again."""


def execution_plan_to_dict(plan: ExecutionPlan, name: str = "") -> dict[str, Any]:
    """Plain values of `plan`, in the form `execution_plan_from_dict` reads."""
    calls = {
        call: {"devices": mesh.size, "first_device": mesh.first, "pp": s.pp, "tp": s.tp, "dp": s.dp}
        for call, (mesh, s) in plan.layouts.items()
    }
    return {**({"name": name} if name else {}), "calls": calls}


def execution_plan_from_dict(
    values: Any, dataflow: Dataflow, cluster: ClusterSpec, where: str = "plan"
) -> tuple[ExecutionPlan, str]:
    """(the plan written as `values`, its name or ""), checked against `dataflow` and `cluster`."""
    if not isinstance(values, dict) or set(values) - set(PLAN_KEYS):
        raise PlanFormatError(where, values, "give calls: {<call>: {devices, first_device, pp, tp, dp}} (and a name)")
    calls = values.get("calls")
    names = [c.name for c in dataflow.calls]
    if not isinstance(calls, dict) or set(calls) != set(names):
        given = sorted(calls) if isinstance(calls, dict) else calls
        raise PlanFormatError(f"{where}.calls", given, f"give a mesh and layout for each call of the run: {names}")
    meshes = set(valid_meshes(cluster))
    layouts = {}
    for call in names:
        at, raw = f"{where}.calls.{call}", calls[call]
        if not isinstance(raw, dict) or set(raw) - set(CALL_KEYS) or "devices" not in raw:
            raise PlanFormatError(at, raw, f"give devices (and first_device, pp, tp, dp): fields {list(CALL_KEYS)}")
        mesh = DeviceRange(int(raw.get("first_device", 0)), int(raw["devices"]))
        if mesh not in meshes:
            raise PlanFormatError(
                at,
                str(mesh),
                f"not a device mesh of this {cluster.n_devices}-device cluster (a slice of one machine whose "
                f"size divides it, aligned, or whole machines); raise placement.num_devices or move it",
            )
        pp, tp = int(raw.get("pp", 1)), int(raw.get("tp", 1))
        dp = int(raw.get("dp", mesh.size // (pp * tp) if mesh.size % (pp * tp) == 0 else 0))
        if pp * tp * dp != mesh.size:
            raise PlanFormatError(at, (pp, tp, dp), f"pp*tp*dp must be the call's {mesh.size} device(s)")
        layouts[call] = (mesh, Mesh(pp, tp, dp))
    plan = ExecutionPlan(layouts)
    refusal = runtime_refusal(plan, dataflow)
    if refusal is not None:
        raise PlanFormatError(f"{where}.calls", "...", refusal)
    return plan, str(values.get("name") or "")
