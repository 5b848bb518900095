"""A model-level `Plan` as plain values (YAML-writable) and back: the form a run config's
`placement.plan` takes when it is written by hand.

    sets:
      - devices: 1                      # the set's device count (one resource pool)
        models:
          actor: {pp: 1, tp: 1, dp: 1, generation: {pp: 1, tp: 1, dp: 1}}
          reference: {pp: 1, tp: 1, dp: 1}
      - devices: 1
        first_device: 1                 # optional: packed after the previous set
        models:
          critic: {pp: 1, tp: 1, dp: 1}

`plan.to_dict()` (or `plan_to_dict(plan)`) writes that form (plus `name` and the estimate, informational);
`plan_from_dict(values, dataflow, specs, workload, cluster)` reads it back and prices it with
the same cost model `automap` uses, so a hand-written plan carries an estimated iteration time
as an auto-mapped one does. Pure functions: no Ray, no files.

Every refusal is a `PlanFormatError` naming the field (`sets[1].models.critic.tp`), the value
and the fix.
"""

from __future__ import annotations

from typing import Any

from workbench.mesh import Mesh
from workbench.planner.automap import AutoMapper, ModelChoice, _Layout, d_cost
from workbench.planner.dataflow import Dataflow
from workbench.planner.errors import PlannerError
from workbench.planner.memory import MemoryBreakdown, inference_activations, static_memory, train_activations
from workbench.planner.placement import ColocatedSet, ModelAssignment, span
from workbench.planner.plan import Plan
from workbench.planner.problem import Problem
from workbench.planner.specs import GIB, ClusterSpec, ModelSpec, Workload
from workbench.planner.strategy import is_generation_layout

LAYOUT_KEYS = ("pp", "tp", "dp")
SET_KEYS = ("devices", "first_device", "models", "name")
PLAN_KEYS = ("name", "sets", "estimated_iteration_s", "source", "cluster", "estimated_call_s", "measured_iteration_s")
"""Besides `sets` (and `name`), keys a run writes in its plan.yaml for the reader (the estimate, where
the plan came from, the measured iteration): ignored when read back (the estimate is recomputed)."""


class PlanFormatError(PlannerError):
    """A plan written as plain values that cannot be read: names the field, the value and the fix."""

    def __init__(self, where: str, value: Any, fix: str):
        self.where, self.value, self.fix = where, value, fix
        super().__init__(f"{where}={value!r}: {fix}")


# ---- writing ----------------------------------------------------------------------------------
def plan_to_dict(plan: Plan, name: str = "") -> dict[str, Any]:
    """Plain values of a model-level plan (`Plan.to_dict`)."""
    return plan.to_dict(name)


# ---- reading ----------------------------------------------------------------------------------
def whole(where: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise PlanFormatError(where, value, f"give a whole number >= {low}")
    return value


def mapping(where: str, value: Any, keys: tuple[str, ...], what: str) -> dict:
    if not isinstance(value, dict):
        raise PlanFormatError(where, value, f"give a mapping of {what}")
    unknown = [k for k in value if k not in keys]
    if unknown:
        raise PlanFormatError(f"{where}.{unknown[0]}", value[unknown[0]], f"not a field here; fields: {list(keys)}")
    return value


def read_layout(where: str, value: Any, n_devices: int) -> Mesh:
    """(pp, tp, dp) of one model on its set's `n_devices`; missing pp/tp default to 1 and a
    missing dp to what the set's devices leave."""
    value = mapping(where, value, (*LAYOUT_KEYS, "generation"), "pp, tp, dp")
    pp, tp = (whole(f"{where}.{k}", value.get(k, 1)) for k in ("pp", "tp"))
    dp = whole(f"{where}.dp", value["dp"]) if "dp" in value else max(1, n_devices // (pp * tp))
    if pp * tp * dp != n_devices:
        raise PlanFormatError(
            where,
            {"pp": pp, "tp": tp, "dp": dp},
            f"pp*tp*dp = {pp * tp * dp}, but the set has {n_devices} device(s): the layout must cover them exactly",
        )
    return Mesh(pp, tp, dp)


def plan_from_dict(
    values: Any,
    dataflow: Dataflow,
    specs: dict[str, ModelSpec],
    workload: Workload,
    cluster: ClusterSpec,
    where: str = "plan",
) -> Plan:
    """The Plan written as `values` (see the module), priced on `cluster` for `workload`: call
    times, level times and iteration time as `automap` prices its own plans.

    Refused (PlanFormatError naming `where`'s field): unknown fields; a model of the dataflow
    missing or one it does not have; a model in two sets; a set's devices beyond the cluster or
    overlapping another's; a layout whose pp*tp*dp is not the set's device count; a layout the
    model does not admit (tp dividing its heads, pp its layers, tp inside one machine); a
    generation layout for a model that does not generate, or one the hybrid engine cannot
    switch to; a set whose memory does not fit a device."""
    values = mapping(where, values, PLAN_KEYS, "sets (and an optional name)")
    sets_in = values.get("sets")
    if not isinstance(sets_in, list) or not sets_in:
        raise PlanFormatError(f"{where}.sets", sets_in, "give a list of colocated sets, each with devices and models")
    mapper = AutoMapper(Problem(dataflow, specs, workload, cluster))
    u, n_total = cluster.devices_per_node, cluster.n_devices
    seen: dict[str, str] = {}
    taken: dict[int, int] = {}
    sets, call_times, level_costs = [], {}, []
    next_first = 0
    for i, raw in enumerate(sets_in):
        at = f"{where}.sets[{i}]"
        raw = mapping(at, raw, SET_KEYS, "devices and models")
        first, n = _read_devices(at, raw, next_first, n_total, taken, i)
        next_first = first + n
        choices = _read_models(at, raw.get("models"), dataflow, specs, n, u, seen)
        colocated, costs, set_times = _priced_set(mapper, at, raw, first, n, choices, cluster)
        sets.append(colocated)
        call_times.update(set_times)
        level_costs.append(costs)
    _check_all_placed(where, dataflow, seen, sets)
    levels = tuple(max(col) for col in zip(*level_costs))
    sets.sort(key=lambda s: s.first_device)
    stats = {"source": "hand-written", "name": str(values.get("name") or ""), "idle_devices": n_total - len(taken)}
    return Plan(dataflow, cluster, workload, tuple(sets), call_times, levels, d_cost(level_costs), stats)


def _read_devices(
    at: str, raw: dict, next_first: int, n_total: int, taken: dict[int, int], index: int
) -> tuple[int, int]:
    """First device and device count of set `index`: packed after the previous set unless its
    `first_device` says where, inside the cluster's `n_total` devices and on none another set
    has `taken` (device -> set; this set's devices are added)."""
    if "devices" not in raw:
        raise PlanFormatError(f"{at}.devices", None, "give the set's device count")
    n = whole(f"{at}.devices", raw["devices"])
    first = whole(f"{at}.first_device", raw.get("first_device", next_first), low=0)
    if first + n > n_total:
        raise PlanFormatError(
            f"{at}.devices",
            n,
            f"devices {first}..{first + n - 1} go beyond the {n_total} device(s) available "
            f"(devices 0..{n_total - 1}): use fewer, or give the run more devices",
        )
    for d in range(first, first + n):
        if d in taken:
            raise PlanFormatError(
                f"{at}.first_device", first, f"device {d} is already set {taken[d]}'s: sets may not share devices"
            )
        taken[d] = index
    return first, n


def _read_models(
    at: str,
    models_in: Any,
    dataflow: Dataflow,
    specs: dict[str, ModelSpec],
    n: int,
    devices_per_node: int,
    seen: dict[str, str],
) -> dict[str, tuple[Mesh, Mesh | None]]:
    """model -> (layout, generation layout) of the set at `at` on its `n` devices. `seen`
    (model -> the set it is in) refuses a model placed twice; this set's models are added."""
    if not isinstance(models_in, dict) or not models_in:
        raise PlanFormatError(f"{at}.models", models_in, "give a mapping model -> {pp, tp, dp}")
    choices = {}
    for m, layout_in in models_in.items():
        mw = f"{at}.models.{m}"
        if m not in dataflow.models:
            raise PlanFormatError(
                mw,
                layout_in,
                f"the algorithm ({dataflow.name}) has no model {m!r} (its models: {list(dataflow.models)}); remove it",
            )
        if m in seen:
            raise PlanFormatError(mw, layout_in, f"{m!r} is already placed in {seen[m]}: give each model one set")
        seen[m] = at
        strategy = read_layout(mw, layout_in, n)
        _check_admits(mw, specs[m], strategy, devices_per_node)
        choices[m] = (strategy, _read_generation(mw, m, layout_in, strategy, dataflow, n))
    return choices


def _read_generation(where: str, model: str, layout: dict, strategy: Mesh, dataflow: Dataflow, n: int) -> Mesh | None:
    """The layout `model` generates in: its `generation` entry, else its training layout (a
    model that trains and generates), else None (no switch between the two to price)."""
    switches = dataflow.generates(model) and dataflow.trained(model)
    if "generation" not in layout:
        return strategy if switches else None
    if not switches:
        raise PlanFormatError(
            f"{where}.generation",
            layout["generation"],
            f"{model!r} does not both train and generate: only the actor has a generation layout; remove it",
        )
    gen = read_layout(f"{where}.generation", layout["generation"], n)
    if not is_generation_layout(strategy, gen):
        raise PlanFormatError(
            f"{where}.generation",
            layout["generation"],
            f"the hybrid engine switches {strategy.short()} only to layouts whose pp divides {strategy.pp} "
            f"and tp divides {strategy.tp} on the same devices",
        )
    return gen


def _priced_set(
    mapper: AutoMapper, at: str, raw: dict, first: int, n: int, choices: dict, cluster: ClusterSpec
) -> tuple[ColocatedSet, list[float], dict[str, float]]:
    """The set at `at` with its layouts priced (`_price`), its level costs and its call times."""
    peak, costs, assigns, call_times = _price(mapper, at, tuple(choices), n, choices, cluster)
    names = tuple(m for m in mapper.flow.models if m in choices)  # in the dataflow's order
    first_, counts, nodes = span(first, n, cluster.devices_per_node)
    name = str(raw.get("name") or "+".join(names))
    return ColocatedSet(name, names, first_, n, counts, nodes, assigns, peak), costs, call_times


def _check_all_placed(where: str, dataflow: Dataflow, seen: dict[str, str], sets: list[ColocatedSet]) -> None:
    """Every model of the dataflow is in some set (`seen`: model -> its set)."""
    missing = [m for m in dataflow.models if m not in seen]
    if missing:
        raise PlanFormatError(
            f"{where}.sets",
            [list(s.models) for s in sets],
            f"the algorithm ({dataflow.name}) needs {missing} too: add them to a set",
        )


def _check_admits(where: str, spec: ModelSpec, s: Mesh, devices_per_node: int) -> None:
    if s.tp > devices_per_node or devices_per_node % s.tp:
        raise PlanFormatError(
            f"{where}.tp", s.tp, f"a tensor-parallel group stays inside one machine of {devices_per_node} device(s)"
        )
    if spec.n_heads % s.tp or spec.n_kv_heads % s.tp:
        raise PlanFormatError(
            f"{where}.tp", s.tp, f"tp must divide the model's {spec.n_heads} heads and {spec.n_kv_heads} KV heads"
        )
    if spec.n_layers % s.pp:
        raise PlanFormatError(f"{where}.pp", s.pp, f"pp must divide the model's {spec.n_layers} layers")


def _price(mapper: AutoMapper, at: str, models: tuple[str, ...], n: int, choices: dict, cluster: ClusterSpec):
    """Peak memory, level costs, assignments and call times of one set with the given layouts
    (the costing of `AutoMapper.set_cost` for one fixed combination)."""
    flow, wl, sim = mapper.flow, mapper.wl, mapper.sim
    layouts = {}
    for m in models:
        s, g = choices[m]
        spec, trained = mapper.specs[m], flow.trained(m)
        calls = [c for c in flow.calls_of(m) if c.kind != "generate"]
        times = {c.name: sim.call_time(c, spec, s, trained=trained) for c in calls}
        act = max(
            [
                train_activations(spec, s, wl) if c.kind == "train" else inference_activations(spec, s, wl)
                for c in calls
            ],
            default=0.0,
        )
        layouts[m] = _Layout(s, g, static_memory(spec, s, trained, wl.param_sharding, wl.frozen_keep), act, times, 0.0)
    q = cluster.device_memory
    static = sum(o.static.total for o in layouts.values())
    result: dict[str, ModelChoice] = {}
    dynamic = 0.0
    for m, o in layouts.items():
        if flow.generates(m):
            choice = mapper._generating_choice(m, o if o.generation else _with_gen(o), q - static)
            if choice is None:
                raise PlanFormatError(
                    f"{at}.models.{m}",
                    choices[m][0].short(),
                    f"its generation does not fit: {static / GIB:.2f} GiB of weights and optimizer state per "
                    f"device leave no room for one sequence's KV cache on {q / GIB:.1f} GiB devices; "
                    f"give the set more devices or move a model out",
                )
            dynamic = max(dynamic, choice.dynamic.total)
        else:
            choice = ModelChoice(o.strategy, None, dict(o.times), o.static, MemoryBreakdown(activations=o.activations))
            dynamic = max(dynamic, o.activations)
        result[m] = choice
    peak = static + dynamic
    if peak > q:
        raise PlanFormatError(
            f"{at}.devices",
            n,
            f"the set needs {peak / GIB:.2f} GiB per device, the device has {q / GIB:.1f} GiB: "
            f"give it more devices or move a model to another set",
        )
    costs = [0.0] * flow.n_levels
    call_times = {}
    assigns = {}
    for m, c in result.items():
        call_times.update(c.call_times)
        for call, t in c.call_times.items():
            costs[mapper.level[call]] += t
        assigns[m] = ModelAssignment(m, mapper.specs[m], c.strategy, c.generation, c.static + c.dynamic, c.transition)
    return peak, costs, assigns, call_times


def _with_gen(layout: _Layout) -> _Layout:
    """A generating model that does not train generates in its own layout."""
    return _Layout(layout.strategy, layout.strategy, layout.static, layout.activations, layout.times, layout.bound)
