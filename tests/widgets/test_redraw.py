"""Views redraw off the loop's thread when fed by `fit`, and a timeline keeps runs apart; no Ray."""

import threading

from widgets import LiveTimeline, MetricsDashboard
from workbench.tracing import CallRecord


def spans(runs: dict[str, int], start: float = 0.0) -> list[CallRecord]:
    """Two ranks' generate calls, one per iteration, run after run."""
    out, t = [], start
    for run, iterations in runs.items():
        for it in range(1, iterations + 1):
            for rank in range(2):
                out.append(
                    CallRecord(
                        len(out),
                        "actor",
                        "generate_sequences",
                        rank,
                        "pool",
                        1,
                        t,
                        t,
                        t + 1.0,
                        0,
                        0,
                        True,
                        {"run": run, "iteration": it, "step": "gen"},
                    )
                )
            t += 1.0
    return out


def test_fit_callbacks_redraw_on_the_view_thread_merging_requests():
    dashboard = MetricsDashboard()
    drawn_on, release = [], threading.Event()

    def slow_listener():  # a front end whose redraw is slow
        drawn_on.append((threading.get_ident(), len(dashboard.history)))
        release.wait(5)

    dashboard._listeners.append(slow_listener)
    for i in range(1, 6):  # five iterations end while the first redraw is still drawing
        dashboard(None, None, {"iteration": i, "critic/score/mean": float(i)})
    assert len(dashboard.history) == 5  # each call returned without waiting for the drawing
    dashboard.background_share = 1.0  # no pause between background redraws
    release.set()
    assert dashboard.wait_drawn(10)
    assert all(ident != threading.get_ident() for ident, _ in drawn_on)
    assert 1 <= len(drawn_on) <= 2 and drawn_on[-1][1] == 5  # merged, and the last shows every iteration
    dashboard.update({"iteration": 6})  # outside fit: drawn before update returns
    assert drawn_on[-1] == (threading.get_ident(), 6)


def test_timeline_names_iterations_by_run_when_a_session_holds_several():
    timeline = LiveTimeline(spans({"GRPO#1": 2, "RLOO#2": 2}), last_iterations=None)
    data = timeline.data()
    assert [i for i, _ in data["iterations"]] == [1, 2, 1, 2]
    assert data["marks"] == ["GRPO#1 it 1", "GRPO#1 it 2", "RLOO#2 it 1", "RLOO#2 it 2"]
    assert "GRPO#1 it 1 to RLOO#2 it 2" in timeline.summary()
    latest = LiveTimeline(spans({"GRPO#1": 2, "RLOO#2": 2}), last_iterations=3).data()
    assert latest["marks"] == ["GRPO#1 it 2", "RLOO#2 it 1", "RLOO#2 it 2"] and latest["spans"] == 6


def test_timeline_since_keeps_one_run():
    timeline = LiveTimeline(spans({"GRPO#1": 2, "RLOO#2": 3}), last_iterations=None, since=2.0)
    assert timeline.data()["marks"] == ["it 1", "it 2", "it 3"]
    assert "iterations 1-3" in timeline.summary()
