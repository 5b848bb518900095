"""Planner: cost model, HybridFlow auto-mapping and ReaLHF plan search, in pure Python: it
imports neither Ray nor torch (an import-linter contract and tests/planner/test_pure.py hold it
to that). `workbench.deploy` starts its plans on a Session and profiles this machine.

    from workbench.planner import Problem, automap, search, dataflow_preset, cluster_preset, Workload
    problem = Problem(dataflow_preset("ppo"), "llama2-7b", Workload(), cluster_preset("a100_80g", 16))
    plan = automap(problem)
    print(plan.table())

Modules, one job each: `specs` (models, workload, cluster), `problem` (what a plan is made
for: those, the dataflow and the layouts the workers run), `clusters` (named clusters, this
machine's from a calibration), `dataflow` (calls of an algorithm), `derive` (reads those calls
off `algorithms/<name>.py`: the built-in dataflows), `strategy` (the 3-D layouts,
`workbench.Mesh`, a model admits), `memory` (per-device bytes, the hybrid engine's Table 2
switch as `workbench.layouts` counts it) and `simulator` (call times) for the
cost model, `automap` (HybridFlow Alg. 1/2: joint layouts per colocated set, aligned
allocations), `placement` (colocated sets and their layouts), `plan` (automap's result, with
its table and Gantt bars), `plan_io` (a plan as YAML values and back, priced), `call_groups` (the
groups a per-call ExecutionPlan needs: replicas, and what runs away from a model's home), `schedule` (TimeCost list
scheduling), `execution` (ReaLHF plans, augmented graph, MaxMem), `search`
(Metropolis-Hastings chains with a convergence report), `report` (tables and Gantt bars),
`measured` (the estimate beside a run's trace: seconds per call and per iteration),
`calibrate` (the local preset fitted from the profiler's timings), `asynchronous` (the iteration
model of an asynchronous plan: generation on a rollout pool overlapping training; `automap_async`
plans one, `async_compare` puts it beside the synchronous placements).
"""

from workbench.planner.asynchronous import AsyncEstimate, Sharing
from workbench.planner.automap import AutoMapper, automap, automap_async, compositions, d_cost, set_partitions
from workbench.planner.clusters import cluster_preset, cluster_presets
from workbench.planner.dataflow import Call, Dataflow
from workbench.planner.derive import DeriveError, dataflow_preset, derive_dataflow
from workbench.planner.errors import (
    ModelDoesNotFitError,
    NoFeasiblePlanError,
    NoMeshError,
    PlannerError,
    UnknownPresetError,
)
from workbench.planner.execution import DeviceRange, Evaluation, ExecutionPlan, PlanEvaluator, mesh, valid_meshes
from workbench.planner.memory import MemoryBreakdown, static_memory
from workbench.planner.placement import ColocatedSet, ModelAssignment
from workbench.planner.plan import AsyncPlan, Plan
from workbench.planner.plan_io import PlanFormatError, plan_from_dict, plan_to_dict
from workbench.planner.problem import Problem
from workbench.planner.report import GanttBar, execution_gantt, execution_table
from workbench.planner.schedule import Schedule, TaskGraph, time_cost
from workbench.planner.search import Convergence, PlanSpace, SearchResult, exhaustive, mcmc, multi_chain, search
from workbench.planner.simulator import Simulator, realloc_bytes
from workbench.planner.specs import MODEL_PRESETS, ClusterSpec, ModelSpec, Workload, model_preset, specs_from_models
from workbench.planner.strategy import strategies

__all__ = [
    "AsyncEstimate",
    "AsyncPlan",
    "AutoMapper",
    "Call",
    "Convergence",
    "ClusterSpec",
    "ColocatedSet",
    "Dataflow",
    "DeriveError",
    "Evaluation",
    "ExecutionPlan",
    "GanttBar",
    "MODEL_PRESETS",
    "MemoryBreakdown",
    "DeviceRange",
    "ModelAssignment",
    "ModelDoesNotFitError",
    "ModelSpec",
    "NoFeasiblePlanError",
    "NoMeshError",
    "Plan",
    "PlanFormatError",
    "PlanEvaluator",
    "PlanSpace",
    "PlannerError",
    "Problem",
    "Schedule",
    "SearchResult",
    "Sharing",
    "Simulator",
    "TaskGraph",
    "UnknownPresetError",
    "Workload",
    "automap",
    "automap_async",
    "cluster_preset",
    "cluster_presets",
    "compositions",
    "d_cost",
    "dataflow_preset",
    "derive_dataflow",
    "execution_gantt",
    "execution_table",
    "exhaustive",
    "mcmc",
    "plan_from_dict",
    "plan_to_dict",
    "mesh",
    "multi_chain",
    "model_preset",
    "realloc_bytes",
    "specs_from_models",
    "search",
    "set_partitions",
    "static_memory",
    "strategies",
    "time_cost",
    "valid_meshes",
]
