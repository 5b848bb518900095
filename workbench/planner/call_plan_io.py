"""A per-call plan (ExecutionPlan) as plain YAML values and back:

    calls:                                   # every call of the dataflow
      gen:          {devices: 1, first_device: 1}             # layout pp 1, tp 1, dp = devices
      values:       {devices: 1, first_device: 1}
      update_actor: {devices: 1, pp: 1, tp: 1, dp: 1}         # first_device 0 when not given
      ...

Read with plan_io's field readers (a model-level plan's layouts read the same way), and the
checks `deploy_calls` makes (what runs away from a model's home: `call_groups.runtime_refusal`),
each refusal a PlanFormatError naming the field."""

from __future__ import annotations

from typing import Any

from workbench.planner.call_groups import runtime_refusal
from workbench.planner.dataflow import Dataflow
from workbench.planner.execution import DeviceRange, ExecutionPlan, valid_meshes
from workbench.planner.plan_io import LAYOUT_KEYS, PlanFormatError, mapping, read_layout, whole
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
        at = f"{where}.calls.{call}"
        raw = mapping(at, calls[call], CALL_KEYS, "devices (and first_device, pp, tp, dp)")
        if "devices" not in raw:
            raise PlanFormatError(at, raw, f"give devices (and first_device, pp, tp, dp): fields {list(CALL_KEYS)}")
        mesh = DeviceRange(
            whole(f"{at}.first_device", raw.get("first_device", 0), low=0), whole(f"{at}.devices", raw["devices"])
        )
        if mesh not in meshes:
            raise PlanFormatError(
                at,
                str(mesh),
                f"not a device range of this {cluster.n_devices}-device cluster (a slice of one machine whose "
                f"size divides it, aligned, or whole machines); raise placement.num_devices or move it",
            )
        layouts[call] = (mesh, read_layout(at, {k: raw[k] for k in LAYOUT_KEYS if k in raw}, mesh.size))
    plan = ExecutionPlan(layouts)
    refusal = runtime_refusal(plan, dataflow)
    if refusal is not None:
        raise PlanFormatError(f"{where}.calls", "...", refusal)
    return plan, str(values.get("name") or "")
