"""Estimate against measurement, on hand-made span records (no Ray)."""

import pytest

from workbench.planner import Problem, Workload, cluster_preset, dataflow_preset, mcmc
from workbench.planner.measured import (
    call_spans,
    check_table,
    compare,
    estimated_call_seconds,
    measured_call_seconds,
)
from workbench.planner.search import PlanSpace
from workbench.tracing import CallRecord


def span(method, step, iteration, start, end, rank=0, call=0, role="actor"):
    extra = {"step": step, "iteration": iteration, "call": call} if step is not None else {}
    return CallRecord(call, role, method, rank, "pool", 1, start, start, end, 0, 0, True, extra)


def test_a_call_spans_its_first_ranks_start_to_its_last_ranks_end():
    records = [
        span("generate_sequences", "gen", 1, 10.0, 11.0, rank=0, call=1),
        span("generate_sequences", "gen", 1, 10.2, 11.5, rank=1, call=1),
        span("hybrid.release", "gen", 1, 11.5, 12.0, call=1),  # a transition the estimate prices apart
        span("replica.receive_weights", "values", 1, 11.0, 13.0, role="critic_d1", call=2),  # a push: left out
        span("compute_values", "values", 1, 13.0, 13.25, role="critic_d1", call=2),
        span("compute_values", None, None, 0.0, 5.0, role="critic"),  # outside an algorithm
    ]
    assert call_spans(records, ["gen", "values"]) == {"gen": {1: 1.5}, "values": {1: 0.25}}


def test_the_median_is_over_the_last_iterations():
    records = [
        span("update_actor", "update_actor", i, 0.0, s, call=i) for i, s in [(1, 9.0), (2, 1.0), (3, 2.0), (4, 3.0)]
    ]
    assert measured_call_seconds(records, ["update_actor", "ref"], last=3) == {"update_actor": 2.0}
    assert measured_call_seconds(records, ["update_actor"], last=1) == {"update_actor": 3.0}
    with pytest.raises(ValueError, match="last must be at least 1"):
        measured_call_seconds(records, ["update_actor"], last=0)


def test_a_call_that_is_no_worker_step_is_refused_by_name():
    with pytest.raises(ValueError, match=r"call\(s\) \['adv', 'typo'\] are not worker steps"):
        call_spans([], ["gen", "adv", "typo"])


def test_compare_rounds_and_keeps_the_measured_order():
    check = compare({"gen": 1.2, "ref": 0.3, "extra": 1.0}, {"ref": 0.2, "gen": 1.0, "values": 0.1}, 2.0, 1.6)
    assert check == {
        "estimated_iteration_s": 2.0,
        "measured_iteration_s": 1.6,
        "iteration_error": 0.25,
        "per_call": {
            "ref": {"estimated_s": 0.3, "measured_s": 0.2, "error": 0.5},
            "gen": {"estimated_s": 1.2, "measured_s": 1.0, "error": 0.2},
        },
    }
    text = check_table(check, where={"gen": "d0-1"})
    assert text.splitlines()[0].split() == ["call", "where", "estimated", "s", "measured", "s", "error"]
    assert "d0-1" in text and "+50%" in text and text.splitlines()[-1].split()[0] == "iteration"
    with pytest.raises(ValueError, match="measured_iteration_s must be positive"):
        compare({}, {}, 1.0, 0.0)


def test_the_estimate_per_call_is_one_iterations_compute_and_dispatch():
    flow = dataflow_preset("ppo")
    space = PlanSpace(Problem(flow, "tiny-1m", Workload.tiny(), cluster_preset("local", 2)))
    evaluation = mcmc(space, max_steps=50, seed=0).evaluation
    estimated = estimated_call_seconds(evaluation)
    assert set(estimated) == {c.name for c in flow.calls}
    assert all(0 < seconds < evaluation.makespan for seconds in estimated.values())
    assert estimated_call_seconds(evaluation, iteration=1) == pytest.approx(estimated)  # unrolled alike
