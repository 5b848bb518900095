"""Live views stream new rows into their figures' data sources on every update, on the
caller's thread, instead of redrawing; a timeline keeps runs apart and opens a clicked span's
batch. No Ray: spans and metrics are made up here."""

import base64
import json
from dataclasses import replace

import pytest
import torch
from bokeh.document.events import ColumnDataChangedEvent, ColumnsStreamedEvent
from bokeh.models import GlyphRenderer

from widgets import LiveTimeline, MetricsDashboard
from widgets.inspector import BatchInspector, MetricsTable
from workbench.data.batch import Batch
from workbench.tracing import CallRecord


def spans(runs: dict[str, int], start: float = 0.0, ranks: int = 2) -> list[CallRecord]:
    """Ranks' generate calls, one per iteration, run after run."""
    out, t = [], start
    for run, iterations in runs.items():
        for it in range(1, iterations + 1):
            for rank in range(ranks):
                out.append(
                    CallRecord(
                        len(out),
                        "actor",
                        "generate_sequences",
                        rank,
                        "pool",
                        1,
                        t,
                        t + 0.25,
                        t + 1.0,
                        1000,
                        3000,
                        True,
                        {"run": run, "iteration": it, "step": "gen", "call": len(out), "rows": 4, "rows_out": 8},
                    )
                )
            t += 1.0
    return out


def events_of(layout) -> list:
    """Record the document events a front end would send to the browser."""
    from bokeh.document import Document

    if layout.document is None:  # as shown: in a document
        Document().add_root(layout)
    events = []
    layout.document.on_change(lambda event: events.append(event))
    return events


def test_dashboard_streams_one_row_per_iteration_into_its_figure():
    dashboard = MetricsDashboard()
    box = dashboard.widget()  # displayed: the figure lives in a jupyter_bokeh widget
    figure = box.children[2]._model
    dashboard(None, None, {"iteration": 1, "critic/score/mean": 1.0, "timing_s/gen": 0.1})  # lines appear
    source = figure.select_one({"name": "metrics"})
    events = events_of(figure)
    for i in range(2, 7):
        dashboard(None, None, {"iteration": i, "critic/score/mean": float(i), "timing_s/gen": 0.1})
        # updated before the callback returned, on this thread, with the one new row
        assert source.data["iteration"][-1] == i and source.data["critic/score/mean"][-1] == float(i)
    streamed = [e for e in events if isinstance(e, ColumnsStreamedEvent)]
    assert len(streamed) == 5 and all(len(e.data["iteration"]) == 1 for e in streamed)
    assert not [e for e in events if isinstance(e, ColumnDataChangedEvent)]  # nothing sent whole
    assert len(dashboard.redraw_seconds) == 6 and max(dashboard.redraw_seconds) < 0.5


class Browser:
    """What a notebook's browser holds of a displayed view: the document it was first sent,
    and the PATCH-DOC messages its widget sends after, applied in order."""

    def __init__(self, view):
        from bokeh.document import Document

        box = view.widget()
        self.widget = box.children[2]
        [doc_json] = self.widget.render_bundle["docs_json"].values()
        self.document = Document.from_json(doc_json)
        self.parts: list = []
        self.messages = 0
        self.widget.send = lambda content, buffers=None: self.parts.append(content["payload"])

    def receive(self) -> None:
        """Apply every message sent so far (header, metadata, content; no binary buffers here)."""
        assert len(self.parts) % 3 == 0, "a message is three parts when it carries no arrays"
        for i in range(0, len(self.parts), 3):
            self.document.apply_json_patch(json.loads(self.parts[i + 2]))
            self.messages += 1
        self.parts.clear()

    def source(self, name: str) -> dict:
        return dict(self.document.get_model_by_name(name).data)


def test_a_displayed_view_sends_each_update_as_one_message_that_rebuilds_its_figure():
    dashboard, trace = MetricsDashboard(), spans({"GRPO#1": 1})
    timeline = LiveTimeline(trace, last_iterations=None)
    views = [Browser(dashboard), Browser(timeline)]
    for i in (1, 2, 3):  # the first row shows its lines (a dozen changes): still one message
        dashboard(None, None, {"iteration": i, "critic/score/mean": float(i), "timing_s/gen": 0.1 * i})
        trace += spans({"GRPO#1": i + 1}, ranks=3)[-3:]  # a new iteration's spans, on a new rank
        timeline.refresh()  # spans, a lane and an iteration mark: one message
        for view in views:
            view.receive()
    assert [view.messages for view in views] == [3, 3]
    figure = views[0].widget._model
    assert views[0].source("metrics") == figure.select_one({"name": "metrics"}).data
    shown = {r.name for r in views[0].document.select({"type": GlyphRenderer}) if r.visible and r.name}
    assert shown == {"critic/score/mean", "timing_s/gen"}
    layout = views[1].widget._model
    for name in ("timeline_spans", "timeline_marks"):
        assert views[1].source(name) == layout.select_one({"name": name}).data
    assert views[1].document.get_model_by_name("timeline_lanes").factors == [f"pool rank {k}" for k in range(3)]
    assert len(views[1].source("timeline_spans")["span"]) == 2 + 3 * 3


def test_dashboard_smoothing_export_and_linked_axes():
    dashboard = MetricsDashboard([{"iteration": i, "critic/score/mean": float(i % 2)} for i in range(1, 5)])
    dashboard.set(smoothing=0.5)
    # debiased EMA: s_t = (sum 0.5^(t-k) * 0.5 * x_k) / (1 - 0.5^t)
    xs = [1.0, 0.0, 1.0, 0.0]
    want = sum(0.5 ** (3 - k) * 0.5 * x for k, x in enumerate(xs)) / (1 - 0.5**4)
    assert dashboard.rows[-1]["critic/score/mean (smoothed)"] == pytest.approx(want)
    lines = dashboard.csv().splitlines()
    assert lines[0] == "iteration,critic/score/mean,critic/score/mean (smoothed)" and len(lines) == 5
    layout, _ = dashboard.figure()
    ranges = {id(fig.x_range) for fig in layout.children}
    assert len(ranges) == 1  # one iteration axis: zooming one chart zooms all
    with pytest.raises(ValueError, match="smoothing must be a number in \\[0, 1\\)"):
        dashboard.set(smoothing=1.5)
    with pytest.raises(ValueError, match="unknown settings \\['smooth'\\]"):
        dashboard.set(smooth=0.5)


def test_timeline_streams_only_the_new_spans():
    trace = spans({"GRPO#1": 1})
    timeline = LiveTimeline(trace, last_iterations=None)
    layout, update = timeline.figure()
    timeline._listeners.append(update)
    calls = layout.select_one({"name": "timeline_spans"})
    events = events_of(layout)
    assert len(calls.data["span"]) == 2
    trace += spans({"GRPO#1": 2}, ranks=3)[3:]  # iteration 2, on a third rank too
    timeline.refresh()
    streamed = {e.model.name: e.data for e in events if isinstance(e, ColumnsStreamedEvent)}
    assert len(streamed["timeline_spans"]["span"]) == 3 and streamed["timeline_marks"]["label"] == ["it 2"]
    assert not [e for e in events if isinstance(e, ColumnDataChangedEvent)]  # nothing sent whole
    assert layout.select_one({"name": "timeline_lanes"}).factors == ["pool rank 0", "pool rank 1", "pool rank 2"]
    assert calls.data["rows"][-1] == "4 -> 8" and calls.data["bytes"][-1].startswith("4.0 kB")
    timeline.refresh()  # nothing new: nothing sent
    assert len([e for e in events if isinstance(e, ColumnsStreamedEvent)]) == 2


def test_clicking_a_span_opens_its_batch_while_held_then_its_metrics():
    timeline = LiveTimeline(spans({"GRPO#1": 3}), last_iterations=None, keep_batches=1)

    class Algorithm:
        run_name = "GRPO#1"

    batch = Batch(
        {
            "responses": torch.ones(2, 3, dtype=torch.long),
            "response_mask": torch.ones(2, 3),
            "advantages": torch.zeros(2, 3),
        }
    )
    for it in (1, 2, 3):
        timeline(Algorithm(), batch, {"iteration": it, "critic/score/mean": 0.5})
    assert timeline.wait_drawn(10) and len(timeline.refresher.cpu_seconds) >= 1  # refreshed off the loop
    layout, update = timeline.figure()
    timeline._listeners.append(update)
    calls = layout.select_one({"name": "timeline_spans"})
    last = calls.data["span"][calls.data["iteration"].index(3)]
    calls.selected.indices = [calls.data["span"].index(last)]  # what a click in the browser does
    assert isinstance(timeline.below(), BatchInspector) and "GRPO#1 iteration 3" in timeline.below().summary()
    first = calls.data["iteration"].index(1)
    calls.selected.indices = [first]
    below = timeline.below()  # the batch of iteration 1 is no longer held: its metrics instead
    assert isinstance(below, MetricsTable) and "critic/score/mean" in below.summary()


def test_timeline_names_iterations_by_run_when_a_session_holds_several():
    timeline = LiveTimeline(spans({"GRPO#1": 2, "RLOO#2": 2}), last_iterations=None)
    data = timeline.data()
    assert [i for i, _ in data["iterations"]] == [1, 2, 1, 2]
    assert data["marks"] == ["GRPO#1 it 1", "GRPO#1 it 2", "RLOO#2 it 1", "RLOO#2 it 2"]
    assert "GRPO#1 it 1 to RLOO#2 it 2" in timeline.summary()
    latest = LiveTimeline(spans({"GRPO#1": 2, "RLOO#2": 2}), last_iterations=3).data()
    assert latest["marks"] == ["GRPO#1 it 2", "RLOO#2 it 1", "RLOO#2 it 2"] and latest["spans"] == 6
    with pytest.raises(ValueError, match="last_iterations must be a positive int"):
        LiveTimeline([], last_iterations=0)


def test_timeline_since_keeps_one_run():
    timeline = LiveTimeline(spans({"GRPO#1": 2, "RLOO#2": 3}), last_iterations=None, since=2.0)
    assert timeline.data()["marks"] == ["it 1", "it 2", "it 3"]
    assert "iterations 1-3" in timeline.summary()


def test_a_cell_value_carries_the_live_widget_and_a_static_picture():
    timeline = LiveTimeline(spans({"GRPO#1": 2}))
    bundle = timeline._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle  # live, where widgets run
    assert base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")  # a saved notebook still shows it
    assert "<img src='data:image/png;base64," in bundle["text/html"]
    page = timeline.html()
    assert "Bokeh" in page and "timeline_spans" in page  # standalone, resources inline


def test_a_dashboard_shown_before_its_run_saves_no_empty_picture():
    dashboard = MetricsDashboard()
    assert "image/png" not in dashboard._repr_mimebundle_()  # a saved notebook shows "no iterations yet"
    dashboard.update({"iteration": 1, "critic/score/mean": 0.5})
    assert base64.b64decode(dashboard._repr_mimebundle_()["image/png"]).startswith(b"\x89PNG")


class Arrivals:
    """A session's `spans_since` over a list that grows: what a live session hands a view."""

    def __init__(self):
        self.spans: list[CallRecord] = []
        self.asked: list[int] = []

    def spans_since(self, cursor: int = 0):
        self.asked.append(cursor)
        return self.spans[cursor:], len(self.spans)


def test_a_followed_session_is_read_from_the_cursor_and_kept_in_order():
    session = Arrivals()
    every = spans({"GRPO#1": 6})
    session.spans = every[:7]  # iterations 1-4, but rank 1's span of iteration 4 is late
    timeline = LiveTimeline(session, last_iterations=2)
    # Iterations 5-6 arrive with it (a slow rank's drain answered now); it started first.
    session.spans += [*every[8:], replace(every[7], start=every[7].start - 0.5)]
    timeline.refresh()
    assert session.asked == [0, 7]  # the second refresh asked only for what came after
    assert [r.start for r in timeline.records] == sorted(r.start for r in timeline.records)
    assert len(timeline.records) == len(timeline.rows) == 12
    whole = LiveTimeline(list(timeline.records), last_iterations=2)  # the same spans, read at once
    assert timeline.shown() == whole.shown() and [r.extra["iteration"] for r in timeline.shown()] == [5, 5, 6, 6]
    assert timeline.data()["marks"] == whole.data()["marks"] and timeline.summary() == whole.summary()
    assert timeline._mark_rows() == whole._mark_rows() and timeline._lanes() == whole._lanes()
