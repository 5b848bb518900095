"""LiveTimeline: the real trace of a running session, a lane per pool and rank.

    timeline = LiveTimeline(session, estimate=plan)     # plan: the planner's Plan, optional
    timeline                                            # in a notebook: the figure
    ppo.fit(prompts, 4, callbacks=[timeline])           # refreshes after every iteration

Bars are calls coloured by role; the part of a call spent fetching its inputs is pale; the
hybrid engine's transitions (spans named `hybrid.*`: weight sync, releasing the rollout
engine) are black. Iterations are marked where their first span starts (spans carry the
iteration and step their algorithm launched them in). With `estimate`, the planner's bars
for the same placement are drawn below, on the same time scale.

Sources: a live `Session` (spans drained as they arrive), a list of CallRecords, or a
`trace.jsonl` written by `widgets.RunRecorder` (the panel app follows a run that way).
"""

from __future__ import annotations

import time
from pathlib import Path

from matplotlib.figure import Figure

from widgets.ui import View, escape, role_colour
from workbench.tracing import CallRecord, load_records


class LiveTimeline(View):
    """The trace of a session (or of saved spans) as a Gantt chart."""

    width, height = 9.0, 3.6

    def __init__(self, source=None, estimate=None, last_iterations: int | None = 3, since: float | None = None):
        """source: a Session, a list of CallRecords or a trace.jsonl path; estimate: a planner
        Plan to draw beside it; last_iterations: show only the latest iterations (None: all);
        since: only spans that started at or after this `time.time()` (a session's trace keeps
        the spans of its earlier runs, whose iteration numbers would mix with this one's)."""
        super().__init__()
        self.source, self.estimate, self.last_iterations, self.since = source, estimate, last_iterations, since
        self.records: list[CallRecord] = []
        self.refresh_seconds: list[float] = []
        """How long each refresh held its caller (draining spans, and redrawing unless in background)."""
        self.refresh()

    def refresh(self, background: bool = False) -> None:
        """Fetch spans that arrived since the last refresh and redraw (with `background`, on the
        drawing thread: see `View.changed`)."""
        t0 = time.perf_counter()
        source = self.source
        if source is None:
            records = []
        elif hasattr(source, "trace"):
            records = source.trace()
        elif isinstance(source, (str, Path)):
            records = load_records(source) if Path(source).exists() else []
        else:
            records = list(source)
        if self.since is not None:
            records = [r for r in records if r.start >= self.since]
        self.records = sorted(records, key=lambda r: r.start)
        self.changed(background)
        self.refresh_seconds.append(time.perf_counter() - t0)

    def __call__(self, algorithm=None, batch=None, metrics=None) -> None:
        """As a `fit` callback: fetch the new spans, and redraw off the loop's critical path."""
        self.refresh(background=True)

    # ---- what the figure shows -----------------------------------------------------------------
    def shown(self) -> list[CallRecord]:
        """The spans in view: all, or those from the first span of the last `last_iterations`
        iterations on (an iteration is one run's: a session may hold several runs' spans)."""
        records = self.records
        firsts = _iteration_starts(records)
        if self.last_iterations and len(firsts) > self.last_iterations:
            first = sorted(firsts.values())[-self.last_iterations]
            records = [r for r in records if r.start >= first]
        return records

    def data(self) -> dict:
        """lanes ("pool rank k"), bars (lane, role, method, start, fetched, end, kind, run,
        iteration, step; seconds from the first span shown), iteration marks in time order
        ((iteration, start), with "marks" naming them by run when several runs are in view), and
        the estimate's bars."""
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
                kind = "transition" if r.method.startswith("hybrid.") else "call"
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
                    }
                )
            starts = sorted(_iteration_starts(records).items(), key=lambda item: item[1])
            several = len({run for (run, _), _ in starts}) > 1
            out["iterations"] = [(it, start - t0) for (_, it), start in starts]
            out["marks"] = [f"{run} it {it}" if several else f"it {it}" for (run, it), _ in starts]
        if self.estimate is not None:
            plan = self.estimate
            sets = {(s.devices.start, s.devices.stop): i for i, s in enumerate(plan.sets)}
            out["estimate_lanes"] = [s.name for s in plan.sets]
            for bar in plan.gantt():
                out["estimate"].append(
                    {
                        "lane": sets[bar.devices],
                        "call": bar.call,
                        "role": plan.dataflow.call(bar.call).model,
                        "start": bar.start,
                        "end": bar.end,
                    }
                )
        return out

    def summary(self) -> str:
        d = self.data()
        if not d["bars"]:
            return "no spans yet"
        span = max(b["end"] for b in d["bars"])
        its = [i for i, _ in d["iterations"]]
        text = f"{d['spans']} spans on {len(d['lanes'])} lanes over {span:.2f} s"
        runs = {b["run"] for b in d["bars"] if b["iteration"] is not None}
        if len(runs) > 1:
            text += f"; {len(its)} iterations, {d['marks'][0]} to {d['marks'][-1]}"
        elif its:
            text += f"; iterations {its[0]}-{its[-1]}" if len(its) > 1 else f"; iteration {its[0]}"
        if self.estimate is not None:
            text += f"; planner estimate {self.estimate.iteration_time:.2f} s per iteration"
        return escape(text)

    def draw(self, fig: Figure) -> None:
        d = self.data()
        rows = [len(d["lanes"]) or 1] + ([len(d["estimate_lanes"])] if d["estimate"] else [])
        axes = fig.subplots(len(rows), 1, sharex=True, gridspec_kw={"height_ratios": rows}, squeeze=False)[:, 0]
        ax = axes[0]
        # One collection per (lane, colour, style): a live refresh draws hundreds of spans.
        groups: dict[tuple, list] = {}
        for b in d["bars"]:
            colour = "black" if b["kind"] == "transition" else role_colour(b["role"])
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
            ax.text(start, -0.6, mark, fontsize=6, color="grey")
        ax.set_yticks(range(len(d["lanes"])), d["lanes"], fontsize=7)
        ax.invert_yaxis()
        ax.set_title("measured (black: hybrid-engine transitions)", fontsize=8)
        if d["estimate"]:
            est = axes[1]
            for b in d["estimate"]:
                est.barh(b["lane"], b["end"] - b["start"], left=b["start"], color=role_colour(b["role"]), height=0.8)
            est.set_yticks(range(len(d["estimate_lanes"])), d["estimate_lanes"], fontsize=7)
            est.invert_yaxis()
            est.set_title("planner's estimate, one iteration", fontsize=8)
        axes[-1].set_xlabel("seconds")
        fig.subplots_adjust(**self.margins)


def _step(record: CallRecord) -> str | None:
    """The step that launched the span (workbench.steps); traces saved before the tag was
    renamed call it "stage"."""
    return record.extra.get("step", record.extra.get("stage"))


def _iteration_starts(records: list[CallRecord]) -> dict[tuple, float]:
    """{(run, iteration): when its first span started}, for spans an algorithm tagged."""
    starts: dict[tuple, float] = {}
    for r in records:
        if "iteration" in r.extra:
            key = (r.extra.get("run", ""), r.extra["iteration"])
            starts[key] = min(starts.get(key, r.start), r.start)
    return starts
