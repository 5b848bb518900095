import re

from workbench.planner import (
    PlanSpace,
    Problem,
    Workload,
    automap,
    cluster_preset,
    dataflow_preset,
    execution_gantt,
    execution_table,
    mcmc,
)


def test_plan_table_and_gantt():
    plan = automap(Problem(dataflow_preset("ppo"), "llama2-7b", Workload(), cluster_preset("a100_80g", 16)))
    text = plan.table()
    for s in plan.sets:
        assert s.name in text
    assert "iteration:" in text and re.search(r"^gen\s+actor\s+generate", text, re.M) and "mem/device" in text
    bars = plan.gantt()
    assert {b.call for b in bars} == {c.name for c in plan.dataflow.calls}
    assert max(b.end for b in bars) <= plan.iteration_time * (1 + 1e-9)
    # Bars on the same devices never overlap in time.
    for a in bars:
        for b in bars:
            if a is not b and a.devices == b.devices:
                assert a.end <= b.start + 1e-9 or b.end <= a.start + 1e-9


def test_uncalibrated_cluster_is_flagged():
    plan = automap(Problem(dataflow_preset("grpo"), "tiny-1m", Workload.tiny(), cluster_preset("local")))
    assert "UNCALIBRATED" in plan.table()


def test_execution_gantt_and_table():
    flow = dataflow_preset("ppo")
    space = PlanSpace(Problem(flow, "tiny-10m", Workload.tiny(), cluster_preset("local")))
    r = mcmc(space, max_steps=200, seed=0)
    bars = execution_gantt(r.evaluation)
    computes = [b for b in bars if b.kind == "compute"]
    assert len(computes) == 2 * len(flow.calls)
    assert all(b.start <= b.end for b in bars)
    assert bars == sorted(bars, key=lambda b: (b.start, b.devices))
    text = execution_table(r.plan, r.evaluation)
    assert "MaxMem" in text and "update_actor" in text
