"""LiveTimeline: the real trace of a running session, a lane per pool and rank.

    timeline = LiveTimeline(session, estimate=plan)     # optional: a Plan, or a per-call plan's Evaluation
    timeline                                            # in a notebook: the live figure
    ppo.fit(prompts, 4, callbacks=[timeline])           # new spans stream in after every iteration

Bars are calls coloured by role; the part of a call spent receiving its inputs (a data
transfer) is pale and hatched; the hybrid engine's transitions (spans named `hybrid.*`: weight
sync, releasing the rollout engine) are thin black bars. A multi-turn rollout's turns are thin
bars inside its call: each turn's batched generation (`episode.generate`, light blue) and the
tool calls after it (`episode.tools`, amber), so generation, tools and training (the update
calls) read apart. Iterations are marked where their first span starts. Scroll to zoom, drag
to pan (the view follows the latest iterations until you do), hover a span for its role, rank,
method, iteration, rows, bytes and seconds; click one to open its batch in a BatchInspector
below (while the batch is still held: the last `keep_batches` iterations of a `fit` it
watches) or else that iteration's metrics. With `estimate`, the planner's bars for the same
placement are drawn below, on the same time axis.

Sources: a live `Session` (spans drained as they arrive), a list of CallRecords, or a
`trace.jsonl` written by `widgets.RunRecorder` (the panel app follows a run that way).
"""

from __future__ import annotations

import bisect
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from matplotlib.figure import Figure

from widgets import plots
from widgets.ui import FigureParts, View, escape, role_colour
from workbench import steps
from workbench.planner.execution import Evaluation
from workbench.planner.report import device_range, execution_gantt
from workbench.tracing import CallRecord, load_records

if TYPE_CHECKING:
    from workbench.planner.plan import Plan

COLUMNS = [
    "span",
    "lane",
    "role",
    "rank",
    "method",
    "kind",
    "run",
    "iteration",
    "step",
    "start",
    "fetched",
    "end",
    "seconds",
    "wait",
    "rows",
    "bytes",
    "colour",
]
INNER_SPANS = {
    "episode.generate": ("generation", "#5fb3e6", "policy turn (generation)"),
    "episode.tools": ("tool", "#f2b701", "tool calls"),
}
"""Spans a worker records inside a call, by name: (kind, colour, legend)."""
MAX_SPANS = 50_000
"""Spans a figure keeps (the oldest roll out): a long run's trace stays bounded in the browser."""


class LiveTimeline(View):
    """The trace of a session (or of saved spans) as a Gantt chart."""

    width, height = 9.0, 3.6

    def __init__(
        self,
        source=None,
        estimate=None,
        last_iterations: int | None = 3,
        since: float | None = None,
        keep_batches: int = 2,
    ):
        """source: a Session, a list of CallRecords or a trace.jsonl path; estimate: the
        planner's estimate to draw beside it, a model-level Plan or a scored per-call plan (the
        Evaluation of a search result or of PlanEvaluator); last_iterations: the figure opens on
        (and follows) the latest iterations, the static picture shows only them (None: all);
        since: only spans that started at or after this `time.time()` (a session's trace keeps
        the spans of its earlier runs); keep_batches: as a `fit` callback, hold the last batches
        for click-through."""
        super().__init__()
        if last_iterations is not None and (not isinstance(last_iterations, int) or last_iterations < 1):
            raise ValueError(f"LiveTimeline: last_iterations must be a positive int or None, got {last_iterations!r}")
        self.source, self.estimate, self.last_iterations, self.since = source, estimate, last_iterations, since
        self.keep_batches = keep_batches
        self.records: list[CallRecord] = []
        self.rows: list[dict] = []
        """One row per span, as the figure's sources hold them (times from `origin`)."""
        self.origin: float | None = None
        self._keys: set = set()  # spans already shown (a file or list source is read whole each time)
        self._cursor = 0  # a session source: spans_since's cursor
        # Kept up to date span by span, so a refresh costs the new spans, not the whole run.
        self._marks = IterationMarks()
        self._lane_set: set[tuple] = set()  # (pool, rank)
        self.refresh_seconds: list[float] = []
        """How long each refresh held its caller (draining spans and streaming them)."""
        self.held: dict[tuple, dict] = {}
        """(run, iteration) -> {"metrics": ..., "batch": ...} seen as a `fit` callback."""
        self.lookup: Callable[[str | None, int], dict] | None = None
        """Where else to look for an iteration's batch or metrics (the app: the run's files)."""
        self.selected: dict | None = None
        """The span clicked last (a row)."""
        self._below: tuple | None = None
        self._cache: dict = {}
        self.refresher = Refresher(self.refresh, f"{type(self).__name__} refresh")
        """Runs `refresh` after each iteration of a `fit` this timeline watches, off the loop."""
        self.refresh()

    # ---- input -------------------------------------------------------------------------------------
    def refresh(self, background: bool = False) -> None:
        """Fetch spans that arrived since the last refresh and stream them into the figures."""
        t0 = time.perf_counter()
        source = self.source
        if source is None:
            records = []
        elif hasattr(source, "spans_since"):  # a session: only the spans new since last time
            records, self._cursor = source.spans_since(self._cursor)
        elif isinstance(source, (str, Path)):
            records = load_records(source) if Path(source).exists() else []
        else:
            records = list(source)
        if self.since is not None:
            records = [r for r in records if r.start >= self.since]
        if hasattr(source, "spans_since"):
            new = records  # the cursor never hands a span over twice
        else:
            new = [r for r in records if _key(r) not in self._keys]
            self._keys.update(_key(r) for r in new)
        if new:
            new.sort(key=_start)
            # New spans start near the end: re-sort only the tail they fall into.
            at = bisect.bisect_right(self.records, new[0].start, key=_start)
            self.records[at:] = sorted([*self.records[at:], *new], key=_start)
            if self.origin is None:
                self.origin = new[0].start
            self._marks.add(new)
            self._lane_set.update((r.pool, r.rank) for r in new)
            self.rows += [self._row(r, len(self.rows) + i) for i, r in enumerate(new)]
            self.changed()
        self.refresh_seconds.append(time.perf_counter() - t0)

    def __call__(self, algorithm=None, batch=None, metrics=None) -> None:
        """As a `fit` callback: hold the iteration's batch (the last `keep_batches`) and metrics,
        and have the view's thread fetch and stream the new spans now (the loop does not wait
        for the workers' trace to be drained; `wait_drawn()` does)."""
        if metrics is not None and "iteration" in metrics:
            key = (getattr(algorithm, "run_name", None), int(metrics["iteration"]))
            self.held[key] = {"metrics": dict(metrics), "batch": batch}
            with_batch = [k for k, v in self.held.items() if v.get("batch") is not None]
            for old in with_batch[: max(0, len(with_batch) - self.keep_batches)]:
                self.held[old]["batch"] = None
        self.refresher.request()

    def wait_drawn(self, timeout: float = 30.0) -> bool:
        """Wait until the refreshes asked for by `fit` so far are done (tests, screenshots)."""
        return self.refresher.wait(timeout)

    def _row(self, r: CallRecord, index: int) -> dict:
        kind = span_kind(r.method)
        rows_in, rows_out = r.extra.get("rows"), r.extra.get("rows_out")
        rows = "-" if rows_in is None else f"{rows_in}" + (f" -> {rows_out}" if rows_out not in (None, rows_in) else "")
        origin = self.origin or 0.0
        return {
            "span": index,
            "lane": f"{r.pool} rank {r.rank}",
            "role": r.role,
            "rank": r.rank,
            "method": r.method,
            "kind": kind,
            "run": r.extra.get("run") or "",
            "iteration": r.extra.get("iteration", "-"),
            "step": _step(r) or "-",
            "start": r.start - origin,
            "fetched": r.fetched - origin,
            "end": r.end - origin,
            "seconds": r.end - r.start,
            "wait": r.fetched - r.start,
            "rows": rows,
            "bytes": _size(r.bytes_in + r.bytes_out) + f" (in {_size(r.bytes_in)}, out {_size(r.bytes_out)})",
            "colour": span_colour(kind, r.role),
        }

    # ---- click-through -----------------------------------------------------------------------------
    def select(self, span: int | None) -> None:
        """Open a span (a row's "span" number; None closes): its batch or its metrics below."""
        self.selected = self.rows[span] if span is not None and 0 <= span < len(self.rows) else None
        self.changed()

    def details(self) -> dict | None:
        """What the selected span opens: {"title", "batch" or "metrics"}, or None."""
        row = self.selected
        if row is None:
            return None
        title = f"{row['role']} rank {row['rank']}: {row['method']}"
        if not isinstance(row["iteration"], int):
            return {"title": title + " (not launched by an algorithm's iteration)", "metrics": None, "batch": None}
        run, it = row["run"] or None, row["iteration"]
        found = self.held.get((run, it)) or next((v for (_, i), v in self.held.items() if i == it), None)
        if (found is None or found.get("batch") is None) and self.lookup is not None:
            found = {**(found or {}), **{k: v for k, v in self.lookup(run, it).items() if v is not None}}
        found = found or {}
        where = f"{run + ' ' if run else ''}iteration {it}"
        return {"title": f"{title}, {where}", "batch": found.get("batch"), "metrics": found.get("metrics")}

    def below(self):
        """The view shown under the figure: a BatchInspector of the selected span's batch, or a
        table of its iteration's metrics."""
        from widgets.inspector import BatchInspector, MetricsTable

        if self.selected is None:
            return None
        if self._below is None or self._below[0] is not self.selected:  # a new click: a new view
            d = self.details() or {}
            view = (
                BatchInspector(d["batch"], title=d["title"])
                if d.get("batch") is not None
                else MetricsTable(d.get("metrics"), title=d.get("title", ""))
            )
            self._below = (self.selected, view)
        return self._below[1]

    # ---- what the figure shows -----------------------------------------------------------------
    def shown(self) -> list[CallRecord]:
        """The spans in view: all, or those from the first span of the last `last_iterations`
        iterations on (an iteration is one run's: a session may hold several runs' spans)."""
        return self._cached("shown", self._shown)

    def _shown(self) -> list[CallRecord]:
        records = self.records
        if self.last_iterations and len(self._marks.order) > self.last_iterations:
            first = self._marks.order[-self.last_iterations][0]
            records = records[bisect.bisect_left(records, first, key=_start) :]
        return records

    def data(self) -> dict:
        """lanes ("pool rank k"), bars (lane, role, method, start, fetched, end, kind, run,
        iteration, step, rows, bytes; seconds from the first span shown), iteration marks in
        time order ((iteration, start), with "marks" naming them by run when several runs are in
        view), and the estimate's bars."""
        records = self.shown()
        out = {
            "lanes": [],
            "bars": [],
            "iterations": [],
            "marks": [],
            "estimate": [],
            "estimate_lanes": [],
            "spans": len(records),
        }
        if records:
            t0 = records[0].start
            lanes = sorted({(r.pool, r.rank) for r in records})
            lane_of = {lane: i for i, lane in enumerate(lanes)}
            out["lanes"] = [f"{pool} rank {rank}" for pool, rank in lanes]
            for r in records:
                kind = span_kind(r.method)
                out["bars"].append(
                    {
                        "lane": lane_of[(r.pool, r.rank)],
                        "role": r.role,
                        "method": r.method,
                        "kind": kind,
                        "start": r.start - t0,
                        "fetched": r.fetched - t0,
                        "end": r.end - t0,
                        "run": r.extra.get("run"),
                        "iteration": r.extra.get("iteration"),
                        "step": _step(r),
                        "call": r.extra.get("call"),
                        "rows": r.extra.get("rows"),
                        "bytes": r.bytes_in + r.bytes_out,
                    }
                )
            out["iterations"], out["marks"] = IterationMarks(records).rows(t0)
        if self.estimate is not None:
            out["estimate_lanes"], out["estimate"] = estimate_bars(self.estimate)
        return out

    def summary(self) -> str:
        return self._cached("summary", self._summary)

    def _summary(self) -> str:
        records = self.shown()
        if not records:
            return "no spans yet"
        t0 = records[0].start
        starts, marks = IterationMarks(records).rows(t0)
        its = [i for i, _ in starts]
        lanes = len({(r.pool, r.rank) for r in records})
        text = f"{len(records)} spans on {lanes} lanes over {max(r.end for r in records) - t0:.2f} s"
        runs = {r.extra.get("run") for r in records if r.extra.get("iteration") is not None}
        if len(runs) > 1:
            text += f"; {len(its)} iterations, {marks[0]} to {marks[-1]}"
        elif its:
            text += f"; iterations {its[0]}-{its[-1]}" if len(its) > 1 else f"; iteration {its[0]}"
        if self.estimate is not None:
            text += f"; planner estimate {estimate_seconds(self.estimate):.2f} s per iteration"
        return escape(text)

    def _cached(self, name: str, compute: Callable[[], Any]) -> Any:
        """`compute()`, once per set of spans: every front end asks after every refresh."""
        if self._cache.get("spans") != len(self.records):
            self._cache = {"spans": len(self.records)}
        if name not in self._cache:
            self._cache[name] = compute()
        return self._cache[name]

    # ---- the live figure ---------------------------------------------------------------------------
    def figure(self) -> FigureParts:
        from bokeh.layouts import column
        from bokeh.models import CDSView, GroupFilter

        # One source for every span (one stream per refresh); each glyph draws its kind.
        spans = plots.Stream(COLUMNS, self.rows, MAX_SPANS, "timeline_spans")  # self.rows grows: send() streams
        calls = CDSView(filter=GroupFilter(column_name="kind", group="call"))
        transitions = CDSView(filter=GroupFilter(column_name="kind", group="transition"))
        fig, x_range, lanes = self._measured_figure()
        bars = self._call_glyphs(fig, spans.source, calls)
        thin = self._thin_glyphs(fig, spans.source, transitions)
        plots.legend_outside(fig, "right")
        marks = self._iteration_marks(fig)
        self._span_tools(fig, spans.source, [bars, *thin])
        parts: list[Any] = [fig]
        estimate = self._estimate_figure(x_range) if self.estimate is not None else None
        if estimate is not None:
            parts.append(estimate[0])
        update = self._figure_update(spans, fig, lanes, marks, x_range, estimate)
        update()
        return column(*parts, sizing_mode="stretch_width"), update

    def _measured_figure(self) -> tuple:
        """The measured spans' figure, its time axis and its lanes (a factor per pool and rank)."""
        from bokeh.models import DataRange1d, FactorRange

        # Bokeh follows the newest spans (the last `last_iterations` iterations' width) until
        # someone pans or zooms; reset returns to following.
        x_range = DataRange1d(name="timeline_x", follow="end", range_padding=0.02)
        lanes = FactorRange(factors=self._lanes() or ["no spans yet"], name="timeline_lanes")
        fig = plots.new_figure(
            "measured: drag to pan, scroll to zoom, hover a span, click it to open its batch",
            x_range=x_range,
            y_range=lanes,
            height=max(220, 60 + 34 * len(lanes.factors)),
            tools="xpan,xwheel_zoom,xbox_zoom,reset,save",
            active_drag="xpan",
            active_scroll="xwheel_zoom",
            x_axis_label="seconds since the first span",
            name="timeline",
        )
        fig.y_range.range_padding = 0.1
        return fig, x_range, lanes

    @staticmethod
    def _call_glyphs(fig, source, calls):
        """A call's bar, drawn from when its inputs arrived, and before it the pale, hatched
        part spent receiving them; returns the bar's renderer (the part a click opens)."""
        bars = fig.hbar(
            y="lane",
            left="fetched",
            right="end",
            height=0.7,
            color="colour",
            line_color="white",
            source=source,
            view=calls,
            legend_field="role",
        )
        fig.hbar(  # waiting for inputs: the data transfer into the call
            y="lane",
            left="start",
            right="fetched",
            height=0.7,
            fill_color="colour",
            fill_alpha=0.3,
            hatch_pattern="/",
            hatch_color="colour",
            hatch_alpha=0.6,
            line_alpha=0,
            source=source,
            view=calls,
            legend_label="receiving inputs",
        )
        return bars

    @staticmethod
    def _thin_glyphs(fig, source, transitions) -> list:
        """Thin bars: the hybrid engine's transitions (black) and the spans inside a call
        (INNER_SPANS, each its own colour and legend entry); returns their renderers."""
        from bokeh.models import CDSView, GroupFilter

        switches = fig.hbar(
            y="lane",
            left="start",
            right="end",
            height=0.3,
            color="black",
            source=source,
            view=transitions,
            legend_label="hybrid-engine transition",
        )
        inner = [
            fig.hbar(
                y="lane",
                left="start",
                right="end",
                height=0.3,
                color="colour",
                source=source,
                view=CDSView(filter=GroupFilter(column_name="kind", group=kind)),
                legend_label=legend,
            )
            for kind, _, legend in INNER_SPANS.values()
        ]
        return [switches, *inner]

    @staticmethod
    def _iteration_marks(fig):
        """A dotted line and a label where each iteration starts; returns their (empty) source."""
        from bokeh.models import ColumnDataSource, LabelSet

        marks = ColumnDataSource({"x": [], "label": []}, name="timeline_marks")
        fig.vspan(x="x", source=marks, line_color="grey", line_dash="dotted")
        fig.add_layout(
            LabelSet(
                x="x",
                y=4,
                y_units="screen",
                x_offset=3,
                text="label",
                source=marks,
                text_font_size="9pt",
                text_color="grey",
            )
        )
        return marks

    def _span_tools(self, fig, source, renderers: list) -> None:
        """Hovering a span shows its details; clicking one selects it (`select`)."""
        from bokeh.models import TapTool

        plots.hover(
            fig,
            renderers,
            [
                ("span", "@role rank @rank: @method"),
                ("iteration", "@run @iteration (step @step)"),
                ("rows", "@rows"),
                ("bytes moved", "@bytes"),
                ("seconds", "@seconds{0.000} (receiving inputs @wait{0.000})"),
            ],
        )
        fig.add_tools(TapTool(renderers=renderers))
        source.selected.on_change("indices", lambda attr, old, new: self._tapped(source, new))

    def _figure_update(self, spans: plots.Stream, fig, lanes, marks, x_range, estimate) -> Callable[[], None]:
        """The figure's update: stream the new spans and iteration marks, grow the lanes, move
        the estimate under the latest iteration and keep the followed window one of its width."""
        marks_sent = [-1]  # the marks' version this figure shows

        def update() -> None:
            spans.send()
            factors = self._lanes()
            if factors and list(lanes.factors) != factors:
                lanes.factors = factors
                fig.height = max(220, 60 + 34 * len(factors))  # a lane keeps its height as pools come
            if self._marks.version != marks_sent[0]:  # a late span moved a mark (rare): send them all
                starts, labels = self._mark_rows()
                marks.data = {"x": starts, "label": labels}
            elif len(self._marks.order) > len(marks.data["x"]):  # new iterations: stream their marks
                starts, labels = self._mark_rows(len(marks.data["x"]))
                marks.stream({"x": starts, "label": labels})
            marks_sent[0] = self._marks.version
            latest = self._marks.order[-1][0] - (self.origin or 0.0) if self._marks.order else None
            if estimate is not None and latest is not None and estimate[2] != latest:
                estimate[1](latest)  # the estimate of one iteration, under the latest one
            width = self._window_width()
            current = x_range.follow_interval
            if width is not None and (current is None or abs(width - current) > 0.2 * current):
                x_range.follow_interval = width  # changes only when iterations' length does

        return update

    def _tapped(self, source, indices: list[int]) -> None:
        if indices:
            self.select(int(source.data["span"][indices[0]]))

    def _lanes(self) -> list[str]:
        lanes = self._cached("lanes", lambda: sorted(self._lane_set))
        return [f"{pool} rank {rank}" for pool, rank in lanes]

    def _mark_rows(self, first: int = 0) -> tuple[list[float], list[str]]:
        """Iteration marks from the `first`th on: x (seconds since the first span), label."""
        starts, names = self._marks.rows(self.origin or 0.0, first)
        return [s for _, s in starts], names

    def _window_width(self) -> float | None:
        """Seconds the latest `last_iterations` iterations take (None: show everything)."""
        shown = self.shown()
        if not shown or len(shown) == len(self.records):
            return None
        return max(r.end for r in shown) - shown[0].start

    def _estimate_figure(self, x_range) -> tuple:
        """The planner's bars of one iteration, a lane per device set, and the function that
        moves them under the latest measured iteration (the figures share the time axis)."""
        from bokeh.models import ColumnDataSource

        d = self.data()
        lanes, bars = d["estimate_lanes"], d["estimate"]
        columns = {
            "lane": [lanes[b["lane"]] for b in bars],
            "call": [b["call"] for b in bars],
            "role": [b["role"] for b in bars],
            "seconds": [b["end"] - b["start"] for b in bars],
            "colour": [role_colour(b["role"]) for b in bars],
        }
        at_zero = {"start": [b["start"] for b in bars], "end": [b["end"] for b in bars]}  # columns of one length
        source = ColumnDataSource({**columns, **at_zero}, name="timeline_estimate")
        fig = plots.new_figure(
            "planner's estimate of one iteration, under the latest measured one (same time axis)",
            x_range=x_range,
            y_range=list(reversed(lanes)),
            height=80 + 34 * len(lanes),
            tools="xpan,xwheel_zoom,reset",
            x_axis_label="seconds since the first span",
        )
        glyphs = fig.hbar(y="lane", left="start", right="end", height=0.7, color="colour", source=source)
        plots.hover(fig, [glyphs], [("call", "@call (@role)"), ("estimated seconds", "@seconds{0.000}")])
        placed = [fig, None, None]

        def place(at: float) -> None:
            source.data = {
                **columns,
                "start": [at + b["start"] for b in bars],
                "end": [at + b["end"] for b in bars],
            }
            placed[2] = at

        place(0.0)
        placed[1] = place
        return placed

    # ---- the static picture ------------------------------------------------------------------------
    def draw(self, fig: Figure) -> None:
        d = self.data()
        rows = [len(d["lanes"]) or 1] + ([len(d["estimate_lanes"])] if d["estimate"] else [])
        axes = fig.subplots(len(rows), 1, sharex=True, gridspec_kw={"height_ratios": rows}, squeeze=False)[:, 0]
        ax = axes[0]
        # One collection per (lane, colour, style): a trace holds hundreds of spans.
        groups: dict[tuple, list] = {}
        for b in d["bars"]:
            colour = span_colour(b["kind"], b["role"])
            if b["fetched"] > b["start"]:  # waiting for inputs: pale
                groups.setdefault((b["lane"], colour, 0.3, 0.8), []).append((b["start"], b["fetched"] - b["start"]))
            height = 0.8 if b["kind"] == "call" else 0.4
            groups.setdefault((b["lane"], colour, 1.0, height), []).append(
                (b["fetched"], max(b["end"] - b["fetched"], 1e-4))
            )
        for (lane, colour, alpha, height), spans in groups.items():
            ax.broken_barh(spans, (lane - height / 2, height), facecolors=colour, alpha=alpha)
        ax.set_xlim(0, max([b["end"] for b in d["bars"]], default=1.0) * 1.01)
        ax.set_ylim(-0.7, max(len(d["lanes"]), 1) - 0.3)
        for (_, start), mark in zip(d["iterations"], d["marks"]):
            ax.axvline(start, color="grey", linewidth=0.6, linestyle=":")
            ax.text(start, -0.6, mark, fontsize=7, color="grey")
        ax.set_yticks(range(len(d["lanes"])), d["lanes"], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(
            "measured (black: hybrid-engine transitions; light blue / amber: an episode's generation / tool calls; "
            "pale: receiving inputs)",
            fontsize=9,
        )
        if d["estimate"]:
            est = axes[1]
            for b in d["estimate"]:
                est.barh(b["lane"], b["end"] - b["start"], left=b["start"], color=role_colour(b["role"]), height=0.8)
            est.set_yticks(range(len(d["estimate_lanes"])), d["estimate_lanes"], fontsize=8)
            est.invert_yaxis()
            est.set_title("planner's estimate, one iteration", fontsize=9)
        axes[-1].set_xlabel("seconds")
        fig.subplots_adjust(**self.margins)


class Refresher:
    """Runs a refresh on its own thread after each request, so a `fit` callback returns at once
    (draining the workers' trace is a round trip to each). Not rationed: every request is
    served, and requests that arrive while a refresh runs are served by one more refresh."""

    def __init__(self, refresh: Callable[[], None], name: str):
        self._refresh, self._name = refresh, name
        self._asked_for = threading.Condition()
        self._asked = self._done = 0
        self._thread: threading.Thread | None = None
        self.cpu_seconds: list[float] = []
        """CPU time of each refresh on this thread: what it takes from the run's own work."""
        self.wall_seconds: list[float] = []

    def request(self) -> None:
        with self._asked_for:
            self._asked += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
            self._asked_for.notify_all()

    def wait(self, timeout: float = 30.0) -> bool:
        with self._asked_for:
            return self._asked_for.wait_for(lambda: self._done >= self._asked, timeout)

    def _serve(self) -> None:
        while True:
            with self._asked_for:
                self._asked_for.wait_for(lambda: self._asked > self._done)
                asked = self._asked
            cpu, wall = time.thread_time(), time.perf_counter()
            try:
                self._refresh()
            except Exception as e:  # keep serving later iterations; the loop itself is unaffected
                warnings.warn(f"{self._name} failed: {e!r}", stacklevel=1)
            self.cpu_seconds.append(time.thread_time() - cpu)
            self.wall_seconds.append(time.perf_counter() - wall)
            with self._asked_for:
                self._done = asked
                self._asked_for.notify_all()


def estimate_bars(estimate: Plan | Evaluation) -> tuple[list[str], list[dict]]:
    """Lanes and bars (lane, call, role, start, end) of one estimated iteration: a model-level
    Plan's (a lane per colocated set), or a scored per-call plan's (an Evaluation, from the
    search or PlanEvaluator: a lane per device mesh, its calls' compute; parameter moves
    between meshes are left out)."""
    if isinstance(estimate, Evaluation):
        bars = [b for b in execution_gantt(estimate) if b.iteration == 0 and b.kind == "compute" and b.call]
        meshes = sorted({b.devices for b in bars})
        lanes = [device_range(*m) for m in meshes]
        return lanes, [
            {
                "lane": meshes.index(b.devices),
                "call": b.call,
                "role": _call_role(b.call),
                "start": b.start,
                "end": b.end,
            }
            for b in bars
        ]
    sets = {(s.devices.start, s.devices.stop): i for i, s in enumerate(estimate.sets)}
    return [s.name for s in estimate.sets], [
        {
            "lane": sets[bar.devices],
            "call": bar.call,
            "role": estimate.dataflow.call(bar.call).model,
            "start": bar.start,
            "end": bar.end,
        }
        for bar in estimate.gantt()
    ]


def estimate_seconds(estimate: Plan | Evaluation) -> float:
    """Estimated seconds per iteration of either kind of estimate."""
    return estimate.time if isinstance(estimate, Evaluation) else estimate.iteration_time


def _call_role(call: str) -> str:
    """The role a planner call (a step name) runs on, for its colour."""
    step = steps.BY_NAME.get(call)
    return step.role if step is not None else call


def _start(record: CallRecord) -> float:
    return record.start


def _key(record: CallRecord) -> tuple:
    """A span's identity (a session's trace() returns every span it still holds)."""
    return record.extra.get("call"), record.role, record.rank, record.method, record.start


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _step(record: CallRecord) -> str | None:
    """The step that launched the span (workbench.steps); traces saved before the tag was
    renamed call it "stage"."""
    return record.extra.get("step", record.extra.get("stage"))


class IterationMarks:
    """Where each (run, iteration) begins: its first span's start, for spans an algorithm
    tagged, kept in time order span by span (a live refresh costs its new spans, not the run)."""

    def __init__(self, records: list[CallRecord] = ()):
        self.first: dict[tuple, float] = {}
        self.order: list[tuple[float, tuple]] = []
        """(start, (run, iteration)) in time order."""
        self.runs: set = set()
        self.version = 0
        """Counts changes other than a mark added at the end (a front end then resends all)."""
        self.add(records)

    def add(self, records: list[CallRecord]) -> None:
        for r in records:
            if "iteration" not in r.extra:
                continue
            key = (r.extra.get("run", ""), r.extra["iteration"])
            old = self.first.get(key)
            if old is not None and r.start >= old:
                continue
            if old is not None:  # a late span started this iteration earlier: its mark moves
                at = bisect.bisect_left(self.order, old, key=_first)
                while self.order[at][1] != key:
                    at += 1
                del self.order[at]
            renamed = len(self.runs) == 1 and key[0] not in self.runs  # labels now name their run
            self.runs.add(key[0])
            self.first[key] = r.start
            at = bisect.bisect_right(self.order, r.start, key=_first)
            self.order.insert(at, (r.start, key))
            if old is not None or renamed or at < len(self.order) - 1:
                self.version += 1

    def rows(self, t0: float, first: int = 0) -> tuple[list[tuple], list[str]]:
        """Marks from the `first`th on: [(iteration, start - t0)], and their names ("it 3", or
        "GRPO#1 it 3" when several runs are in view)."""
        several = len(self.runs) > 1
        marks = self.order[first:]
        return (
            [(it, start - t0) for start, (_, it) in marks],
            [f"{run} it {it}" if several else f"it {it}" for _, (run, it) in marks],
        )


def _first(mark: tuple[float, tuple]) -> float:
    return mark[0]


def span_kind(method: str) -> str:
    """What a span is drawn as: "call" (a driver call), "transition" (the hybrid engine's
    `hybrid.*`), or an inner span's kind ("generation", "tool": INNER_SPANS)."""
    if method.startswith("hybrid."):
        return "transition"
    return INNER_SPANS[method][0] if method in INNER_SPANS else "call"


def span_colour(kind: str, role: str) -> str:
    if kind == "transition":
        return "black"
    return next((colour for k, colour, _ in INNER_SPANS.values() if k == kind), None) or role_colour(role)
