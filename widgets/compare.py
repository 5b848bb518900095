"""RunComparison: several runs' metrics on one set of charts, and what differs between them.

    compare = RunComparison({"clip 0.2": "runs/a", "clip 0.28": "runs/b"})   # run directories
    compare                                                 # in a notebook: the overlaid charts
    compare.set(align="time")                              # by wall-clock instead of iteration
    compare.config_diff()                                  # {field: {run: value}}, differing only

A run is a directory (the headless runner's or a RunRecorder's: its `metrics.jsonl`, and its
`config.yaml` when it has one), a metrics file, a `MetricsDashboard` (followed live: the
comparison redraws whenever it gets an iteration, so a `fit` in progress can be one of the
runs) or a list of metrics dicts (what `fit` returns). The charts are the dashboard's, one
colour per run and one dash per metric. A redone iteration (a run that recovered) counts once,
its redo. Aligned by "iteration", or by "time": seconds since the run's first iteration started
(`run/elapsed_s` where the runner logged it, else the sum of `timing_s/step`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from matplotlib.figure import Figure

from widgets import plots
from widgets.dashboard import (
    CHARTS,
    COLOURS,
    STEP_TIMES,
    MetricsDashboard,
    _check_smoothing,
    _short,
    ema_step,
    smoothing_control,
)
from widgets.ui import Control, FigureParts, View, escape

ALIGN = {"iteration": "iteration", "time": "wall-clock (s)"}
DASHES = ("solid", "dashed", "dotted", "dotdash")
MATPLOTLIB_DASHES = {"solid": "-", "dashed": "--", "dotted": ":", "dotdash": "-."}
MISSING = "(unset)"


class RunComparison(View):
    """Charts of several runs' metrics, overlaid, with the fields their configs differ in."""

    width, height = 10.0, 4.8
    margins = {"left": 0.05, "right": 0.99, "top": 0.93, "bottom": 0.07, "wspace": 0.3, "hspace": 0.35}

    def __init__(
        self,
        runs: Mapping[str, Any] | list,
        align: str = "iteration",
        smoothing: float = 0.0,
        configs: Mapping[str, Any] | None = None,
    ):
        """runs: {name: run}, or a list of run directories (named by their folder). configs:
        {name: a dict or dataclass}, for runs that have no config.yaml (a notebook's `fit`)."""
        super().__init__()
        if not isinstance(runs, Mapping):  # named by folder; two of one name: by path
            names = [Path(r).name for r in runs]
            runs = {(n if names.count(n) == 1 else str(r)): r for n, r in zip(names, runs)}
        if len(runs) < 1:
            raise ValueError("RunComparison: give at least one run: {name: run directory, metrics file or dashboard}")
        self.runs = {str(name): _Run(str(name), run) for name, run in runs.items()}
        unknown = set(configs or {}) - set(self.runs)
        if unknown:
            raise ValueError(f"RunComparison configs: no run named {sorted(unknown)}; runs: {sorted(self.runs)}")
        for name, config in (configs or {}).items():
            self.runs[name].config = _plain(config)
        self.align, self.smoothing = "iteration", 0.0
        self.set(align=align, smoothing=smoothing)
        for run in self.runs.values():
            if run.dashboard is not None:  # a live run: redraw when it gets an iteration
                run.dashboard._listeners.append(self.changed)

    # ---- settings ----------------------------------------------------------------------------
    def controls(self) -> list[Control]:
        return [
            Control("align", "align by", "choice", {v: k for k, v in ALIGN.items()}, self.align, "the x axis"),
            smoothing_control(self.smoothing),
        ]

    def set(self, **values) -> None:
        unknown = set(values) - {"align", "smoothing"}
        if unknown:
            raise ValueError(f"RunComparison.set: unknown settings {sorted(unknown)}; it has 'align' and 'smoothing'")
        if "align" in values:
            if values["align"] not in ALIGN:
                raise ValueError(f"RunComparison: align={values['align']!r}; give one of {list(ALIGN)}")
            self.align = values["align"]
        if "smoothing" in values:
            _check_smoothing(values["smoothing"], "RunComparison")
            self.smoothing = float(values["smoothing"])
        self.changed()

    def reload(self) -> bool:
        """Read the runs' files again where they changed (a run still going grows); True when
        one did (the figures are then brought up to date)."""
        changed = [run.reload() for run in self.runs.values()]
        if any(changed):
            self.changed()
        return any(changed)

    # ---- data --------------------------------------------------------------------------------
    def aligned(self) -> dict[str, list[tuple[float, dict]]]:
        """{run: [(x, metrics), ...]}: each iteration once (a redone one: its redo), in
        iteration order, x its iteration or its seconds since the run's start."""
        return {name: run.points(self.align) for name, run in self.runs.items()}

    def charts(self) -> dict[str, list[str]]:
        """{chart: metrics any run reports}, the dashboard's charts in its order."""
        seen = {k for run in self.runs.values() for row in run.rows() for k in row}
        out = {chart: [k for k in keys if k in seen] for chart, keys in CHARTS.items()}
        out["score"] += sorted(k for k in seen if k.startswith("reward/") and k.endswith("/mean"))
        out["held-out"] = sorted(k for k in seen if k.startswith("eval/"))
        out[STEP_TIMES] = sorted(k for k in seen if k.startswith("timing_s/"))
        return {chart: keys for chart, keys in out.items() if keys}

    def data(self) -> dict:
        """{chart: {metric: {run: (xs, values)}}}: the raw values, then smoothed as shown."""
        points = self.aligned()
        out: dict = {}
        for chart, keys in self.charts().items():
            out[chart] = {}
            for key in keys:
                for name, rows in points.items():
                    xs = [x for x, m in rows if key in m]
                    if xs:
                        out[chart].setdefault(key, {})[name] = (xs, [float(m[key]) for _, m in rows if key in m])
        return out

    def smoothed(self, values: list[float]) -> list[float]:
        """The debiased exponential moving average the dashboard draws (TensorBoard's)."""
        state, out = (0.0, 0.0), []
        for value in values:
            state = ema_step(state, value, self.smoothing)
            out.append(state[0] / state[1] if state[1] else math.nan)
        return out

    def config_diff(self) -> dict[str, dict[str, Any]]:
        """{field: {run: value}} for every config field (dotted: "actor.optim.lr") whose value
        is not the same in every run that has a config; a run without that field: "(unset)"."""
        flat = {name: _flatten(run.config) for name, run in self.runs.items() if run.config is not None}
        fields = sorted({f for config in flat.values() for f in config})
        diff = {}
        for f in fields:
            values = {name: config.get(f, MISSING) for name, config in flat.items()}
            if len({json.dumps(v, sort_keys=True, default=str) for v in values.values()}) < 2:
                continue
            if all(v in (None, MISSING) for v in values.values()) and any(g.startswith(f + ".") for g in fields):
                continue  # a section one run leaves out (None) and another sets: its fields say it
            diff[f] = values
        return diff

    def colour(self, name: str) -> str:
        return COLOURS[list(self.runs).index(name) % len(COLOURS)]

    def summary(self) -> str:
        items = []
        for name, run in self.runs.items():
            rows = run.points(self.align)
            last = f"{len(rows)} iterations" if rows else "no iterations yet"
            swatch = f"<span style='color:{self.colour(name)}'>&#9632;</span>"
            items.append(f"{swatch} <b>{escape(name)}</b> ({last}, {escape(run.source)})")
        parts = ["&nbsp;&nbsp;".join(items)]
        diff = self.config_diff()
        with_config = [n for n, r in self.runs.items() if r.config is not None]
        if len(with_config) > 1:
            if not diff:
                parts.append("their configs are the same")
            else:
                head = "".join(f"<th>{escape(n)}</th>" for n in with_config)
                body = "".join(
                    f"<tr><td><code>{escape(f)}</code></td>"
                    + "".join(f"<td>{escape(values[n])}</td>" for n in with_config)
                    + "</tr>"
                    for f, values in diff.items()
                )
                parts.append(f"<table><tr><th>differs</th>{head}</tr>{body}</table>")
        return "<br>".join(parts)

    def drawn(self) -> bool:
        return any(run.rows() for run in self.runs.values())

    # ---- the live figure ---------------------------------------------------------------------
    def figure(self) -> FigureParts:
        from bokeh.models import Column, DataRange1d, Row

        x_range = DataRange1d(name="compare_x", range_padding=0.02)
        grid = Row(children=[], styles={"flex-wrap": "wrap"}, sizing_mode="stretch_width")
        made: dict = {}  # (chart, metric, run) -> its source; rebuilt when a new line appears

        def build() -> None:
            made.clear()
            figures = []
            for chart, series in self.data().items():
                fig = plots.new_figure(
                    chart,
                    x_range=x_range,
                    height=300,
                    width=430,
                    sizing_mode="fixed",
                    tools="xpan,xwheel_zoom,box_zoom,reset,save",
                    active_scroll=None,
                    x_axis_label=ALIGN[self.align],
                )
                lines = []
                for m, (key, by_run) in enumerate(series.items()):
                    for name in by_run:
                        source = _source()
                        made[(chart, key, name)] = source
                        label = f"{name}: {_short(key)}" if len(series) > 1 else name
                        line = fig.line(
                            "x", "smoothed", source=source, color=self.colour(name), line_width=2,
                            line_dash=DASHES[m % len(DASHES)], legend_label=label,
                        )  # fmt: skip
                        fig.scatter("x", "value", source=source, color=self.colour(name), alpha=0.3, legend_label=label)
                        lines.append(line)
                plots.hover(fig, lines, [("run / metric", "@label"), ("x", "@x{0.[00]}"), ("value", "@value{0.0000}")])
                plots.legend_outside(fig, "below", ncols=2)
                figures.append(fig)
            grid.children = figures or [Column()]

        def update() -> None:
            data = self.data()
            wanted = {
                (chart, key, name) for chart, series in data.items() for key, runs in series.items() for name in runs
            }
            if wanted != set(made) or _x_label(grid) != ALIGN[self.align]:
                build()
            for (chart, key, name), source in made.items():
                xs, values = data[chart][key][name]
                label = f"{name}: {_short(key)}"
                source.data = {"x": xs, "value": values, "smoothed": self.smoothed(values), "label": [label] * len(xs)}

        update()
        return grid, update

    # ---- the static picture ------------------------------------------------------------------
    def draw(self, fig: Figure) -> None:
        data = self.data()
        axes = fig.subplots(2, 4).ravel()
        for ax, (chart, series) in zip(axes, data.items()):
            for m, (key, by_run) in enumerate(series.items()):
                for name, (xs, values) in by_run.items():
                    label = f"{name}: {_short(key)}" if len(series) > 1 else name
                    dash = MATPLOTLIB_DASHES[DASHES[m % len(DASHES)]]
                    ax.plot(xs, self.smoothed(values), dash, color=self.colour(name), label=label)
            ax.set_title(chart, fontsize=9)
            ax.set_xlabel(ALIGN[self.align], fontsize=7)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=6)
        for ax in axes[len(data) :]:
            ax.set_axis_off()
        fig.subplots_adjust(**self.margins)


class _Run:
    """One run's metrics: from its files (read again on `reload`), a live dashboard or a list."""

    def __init__(self, name: str, run: Any):
        self.name, self.config, self.dashboard = name, None, None
        self.history: list[dict] = []
        self.path: Path | None = None
        self.stamp: int | None = None  # the metrics file's mtime when last read
        if isinstance(run, MetricsDashboard):
            self.dashboard, self.source = run, "live"
        elif isinstance(run, (list, tuple)):
            if not all(isinstance(row, Mapping) for row in run):
                raise ValueError(f"RunComparison run {name!r}: a list must hold one metrics dict per iteration")
            self.history, self.source = [dict(row) for row in run], "metrics"
        elif isinstance(run, (str, Path)):
            path = Path(run)
            self.path = path if path.suffix == ".jsonl" else path / "metrics.jsonl"
            if not self.path.is_file():
                raise FileNotFoundError(
                    f"RunComparison run {name!r}: no metrics at {self.path}; give a run directory (one with "
                    f"metrics.jsonl, as the runner or RunRecorder writes), a metrics file or a MetricsDashboard"
                )
            config = self.path.parent / "config.yaml"
            if config.is_file():
                self.config = yaml.safe_load(config.read_text()) or {}
            self.source = str(path)
            self.reload()
        else:
            raise ValueError(
                f"RunComparison run {name!r}: a {type(run).__name__}; give a run directory, a metrics "
                f"file, a MetricsDashboard or a list of metrics dicts"
            )

    def reload(self) -> bool:
        stamp = self.path.stat().st_mtime_ns if self.path is not None and self.path.exists() else None
        if stamp is None or stamp == self.stamp:
            return False
        self.history, self.stamp = MetricsDashboard.from_jsonl(self.path).history, stamp
        return True

    def rows(self) -> list[dict]:
        return self.dashboard.history if self.dashboard is not None else self.history

    def points(self, align: str) -> list[tuple[float, dict]]:
        by_iteration: dict[float, dict] = {}
        steps = offset = last = 0.0
        for row in self.rows():
            if "iteration" not in row:
                continue
            it = float(row["iteration"])
            trained = any(k.startswith(("actor/", "critic/", "timing_s/step")) for k in row)
            steps += float(row.get("timing_s/step", 0.0)) if trained else 0.0
            elapsed = steps
            if "run/elapsed_s" in row:  # the runner's clock; a resumed run's starts again at 0
                raw = float(row["run/elapsed_s"])
                offset, last = offset + (last if raw < last else 0.0), raw
                elapsed = offset + raw
            earlier = by_iteration.get(it, {})
            if trained:  # a redo replaces the failed try, keeping that iteration's held-out scores
                held = {k: v for k, v in earlier.items() if k.startswith("eval/")}
                by_iteration[it] = {**row, **held, "_elapsed": elapsed}
            else:  # an evaluation's row (held-out scores, no step): joins its iteration's point
                held = {k: v for k, v in row.items() if k.startswith("eval/")}
                by_iteration[it] = {"iteration": row["iteration"], "_elapsed": elapsed, **earlier, **held}
        rows = sorted(by_iteration.items())
        if align == "iteration":
            return [(it, _strip(row)) for it, row in rows]
        return [(row["_elapsed"], _strip(row)) for _, row in rows]


def _strip(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "_elapsed"}


def _source():
    from bokeh.models import ColumnDataSource

    return ColumnDataSource({"x": [], "value": [], "smoothed": [], "label": []})


def _x_label(grid) -> str | None:
    figures = [c for c in grid.children if hasattr(c, "xaxis")]
    return figures[0].xaxis[0].axis_label if figures else None


def _plain(config: Any) -> dict:
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    elif hasattr(config, "to_dict"):
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise ValueError(f"RunComparison configs: a {type(config).__name__}; give a dict or a dataclass")
    return dict(config)


def _flatten(config: Mapping, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out |= _flatten(value, name + ".")
        else:
            out[name] = value
    return out
