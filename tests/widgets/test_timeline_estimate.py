"""The live timeline beside a per-call plan's estimate (a searched ReaLHF plan scored by
PlanEvaluator): a lane per device mesh, a bar per call of one iteration, on hand-made spans."""

from widgets.timeline import LiveTimeline
from workbench.mesh import Mesh
from workbench.planner import (
    DeviceRange,
    ExecutionPlan,
    PlanEvaluator,
    Problem,
    Workload,
    cluster_preset,
    dataflow_preset,
)
from workbench.tracing import CallRecord

FLOW = dataflow_preset("ppo")


def test_a_per_call_estimate_has_a_lane_per_mesh():
    # The actor's generation and the critic's values on d1, everything else on d0.
    plan = ExecutionPlan(
        {c.name: (DeviceRange(1 if c.name in ("gen", "values") else 0, 1), Mesh(1, 1, 1)) for c in FLOW.calls}
    )
    evaluation = PlanEvaluator(Problem(FLOW, "tiny-1m", Workload.tiny(), cluster_preset("local", 2))).evaluate(plan)
    spans = [CallRecord(0, "actor", "generate_sequences", 0, "calls_d1", 1, 0.0, 0.0, 0.5, 0, 0, True, {})]
    timeline = LiveTimeline(spans, estimate=evaluation)
    data = timeline.data()
    assert data["estimate_lanes"] == ["d0", "d1"]
    lanes = {b["call"]: data["estimate_lanes"][b["lane"]] for b in data["estimate"]}
    assert lanes == {c.name: "d1" if c.name in ("gen", "values") else "d0" for c in FLOW.calls}  # each call once
    roles = {b["call"]: b["role"] for b in data["estimate"]}
    assert roles["gen"] == "actor" and roles["values"] == "critic" and roles["reward"] == "reward"
    assert max(b["end"] for b in data["estimate"]) <= evaluation.makespan
    assert f"planner estimate {evaluation.time:.2f} s per iteration" in timeline.summary()
    assert timeline.png()
    timeline.figure()  # the interactive figure takes it too


def test_a_model_level_plan_still_has_a_lane_per_colocated_set():
    from widgets import Scenario, estimate

    plan = estimate(Scenario(algorithm="GRPO", machines=1, devices_per_machine=2, placement="colocate")).plan
    data = LiveTimeline([], estimate=plan).data()
    assert data["estimate_lanes"] == ["actor+reference+reward"]
    assert {b["call"] for b in data["estimate"]} == {c.name for c in plan.dataflow.calls}
