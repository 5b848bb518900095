"""Plans onto a live Session, and this machine profiled for the planner: the layer above the
session that the pure planner (workbench.planner: no Ray, no torch) leaves out.

`plans` (a HybridFlow plan: one pool per colocated set, a group per model), `calls` (a per-call
ExecutionPlan: replicas, and `routing`'s handles that send each call to its group) and
`profiler` (model calls and collectives timed on this machine, fitted into a calibration).
`netns_cluster` makes a Ray cluster of several hosts on this machine to deploy onto (network
namespaces; `python -m workbench.deploy.netns_cluster up`, docs/cluster.md).
"""

from workbench.deploy.calls import deploy_calls
from workbench.deploy.plans import deploy_plan, plan_pools
from workbench.deploy.routing import CallRouter

__all__ = ["CallRouter", "deploy_calls", "deploy_plan", "plan_pools"]
