"""What a plan is made for: one dataflow, its models, a workload and a cluster, and the layouts
the workers that will run the plan implement. Every planner entry point (`automap`,
`automap_async`, `compare_async`, `search`) and the objects behind them (`AutoMapper`,
`PlanEvaluator`, `PlanSpace`) take one, so they cannot be handed parts of two different ones.

    problem = Problem(dataflow_preset("ppo"), "llama2-7b", Workload(), cluster_preset("a100_80g", 16))
    plan = automap(problem)
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from workbench.planner.dataflow import Dataflow
from workbench.planner.specs import ClusterSpec, ModelSpec, Workload


@dataclass(frozen=True)
class Problem:
    """The scenario a plan is made for: plans of one problem are comparable, plans of two are not."""

    dataflow: Dataflow
    """The calls of one iteration."""
    models: ModelSpec | str | dict
    """One spec or preset name for every role, or a dict role -> spec/preset (`Dataflow.model_specs`)."""
    workload: Workload
    """Shapes of one iteration."""
    cluster: ClusterSpec
    """The devices to place on."""
    max_tp: int | None = None
    """Largest tensor parallelism the workers that run the plan implement (None: any)."""
    max_pp: int | None = None
    """Largest pipeline parallelism they implement (None: any); max_tp=1, max_pp=1: data
    parallelism only (backend="fsdp")."""

    @functools.cached_property
    def specs(self) -> dict[str, ModelSpec]:
        """A spec per role of the dataflow (value roles with a scalar head), worked out once."""
        return self.dataflow.model_specs(self.models)

    def with_workload(self, workload: Workload) -> Problem:
        """The same problem for another workload (e.g. another way of keeping frozen models)."""
        return dataclasses.replace(self, workload=workload)
