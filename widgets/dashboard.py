"""MetricsDashboard: an algorithm's metrics over iterations, growing while `fit` runs.

    dashboard = MetricsDashboard()
    dashboard                                        # in a notebook: the charts
    ppo.fit(prompts, 10, log=None, callbacks=[dashboard])

Charts: score and rewards, KL, losses, clip fractions, response length, throughput and the
time of each step. A chart shows whichever of its metrics the algorithm reports (verl's
names). Every chart shares one iteration axis: zoom or pan one and all follow. Lines are
smoothed (an exponential moving average, as TensorBoard's slider; raw values are the faint
dots), legends sit beside the data and hide a line when clicked, and "export CSV" downloads
the numbers shown. Each iteration streams one row into the charts' data source.
`MetricsDashboard.from_jsonl(path)` reads a run's metrics file (RunRecorder's).
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

from matplotlib.figure import Figure

from widgets import plots
from widgets.ui import Action, Control, FigureParts, View, escape
from workbench import steps

CHARTS = {
    "score": ("critic/score/mean", "critic/rewards/mean", "safe/cost/mean"),
    "KL": ("actor/ppo_kl", "actor/reward_kl_penalty", "actor/kl_loss"),
    "losses": ("actor/pg_loss", "critic/vf_loss", "actor/entropy"),
    "clip fractions": ("actor/pg_clipfrac", "critic/vf_clipfrac"),
    "response length": ("response_length/mean",),
    "throughput (tokens/s)": ("perf/throughput",),
}
STEP_TIMES = "step times (s)"
EMA_JS = """
const out = new Float64Array(xs.length);
let total = 0, norm = 0;
for (let i = 0; i < xs.length; i++) {
  const x = xs[i];
  if (x != null && Number.isFinite(x)) {
    total = weight * total + (1 - weight) * x;
    norm = weight * norm + (1 - weight);
  }
  out[i] = norm > 0 ? total / norm : NaN;
}
return out;
"""
"""The debiased exponential moving average of `_extend`, over a whole column, in the browser."""
COLOURS = (
    "#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c",
    "#ccb974", "#64b5cd", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#17becf",
)  # fmt: skip
SMOOTHED = " (smoothed)"


class MetricsDashboard(View):
    """Charts of metrics dicts, one per iteration."""

    width, height = 10.0, 4.8
    margins = {"left": 0.05, "right": 0.99, "top": 0.93, "bottom": 0.07, "wspace": 0.3, "hspace": 0.35}

    def __init__(self, history: list[dict] | None = None, smoothing: float = 0.0):
        super().__init__()
        _check_smoothing(smoothing)
        self.smoothing = smoothing
        self.history: list[dict] = []
        self.rows: list[dict] = []
        """One row per iteration as the charts hold it: iteration, each metric, each smoothed."""
        self.version = 0
        """Bumped when rows are rebuilt (new smoothing, a reloaded file): front ends start over."""
        self._ema: dict[str, tuple[float, float]] = {}
        self._seen: set[str] = set()
        self._extend(list(history or []))

    @classmethod
    def from_jsonl(cls, path: str | Path) -> MetricsDashboard:
        dashboard = cls()
        dashboard.load(path)
        return dashboard

    def load(self, path: str | Path) -> None:
        """Take a metrics file's lines (a half-written last line is skipped): new lines stream
        in; a file that is not the history's continuation replaces it."""
        history = []
        if Path(path).exists():
            for line in Path(path).read_text().splitlines():
                try:
                    history.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        if history[: len(self.history)] != self.history:
            self._rebuild(history)
        else:
            self._extend(history[len(self.history) :])
        self.changed()

    def update(self, metrics: dict, background: bool = False) -> None:
        """Add one iteration's metrics and stream it into the charts."""
        self._extend([metrics])
        self.changed()

    def __call__(self, algorithm=None, batch=None, metrics=None) -> None:
        """As a `fit` callback."""
        if metrics is not None:
            self.update(metrics)

    def controls(self) -> list[Control]:
        return [smoothing_control(self.smoothing)]

    def set(self, **values) -> None:
        unknown = set(values) - {"smoothing"}
        if unknown:
            raise ValueError(f"MetricsDashboard.set: unknown settings {sorted(unknown)}; it has 'smoothing'")
        if "smoothing" in values:
            _check_smoothing(values["smoothing"])
            self.smoothing = float(values["smoothing"])
            self._rebuild(self.history)
        self.changed()

    def actions(self) -> list[Action]:
        return [Action("export CSV", "metrics.csv", self.csv)]

    # ---- rows ----------------------------------------------------------------------------------
    def _rebuild(self, history: list[dict]) -> None:
        self.history, self.rows, self._ema, self._seen = [], [], {}, set()
        self.version += 1
        self._extend(history)

    def _extend(self, history: list[dict]) -> None:
        w = self.smoothing
        for metrics in history:
            self.history.append(dict(metrics))
            self._seen.update(metrics)  # metric names so far (charts() asks on every update)
            row = {"iteration": metrics.get("iteration", len(self.history))}
            for key in self.keys(metrics):
                value = float(metrics[key])
                row[key] = value
                total, weight = self._ema[key] = ema_step(self._ema.get(key, (0.0, 0.0)), value, w)
                row[key + SMOOTHED] = total / weight if weight else math.nan
            self.rows.append(row)

    @staticmethod
    def keys(metrics: dict) -> list[str]:
        """The metrics of `metrics` that a chart shows."""
        charted = {k for keys in CHARTS.values() for k in keys}
        return [k for k in metrics if k in charted or k.startswith("timing_s/")]

    def charts(self) -> dict[str, list[str]]:
        """{chart: metrics present in the history}, in CHARTS' order, then the step times."""
        seen = self._seen
        out = {chart: [k for k in keys if k in seen] for chart, keys in CHARTS.items()}
        # several reward functions: each one's mean beside the score they add up to
        out["score"] += sorted(k for k in seen if k.startswith("reward/") and k.endswith("/mean"))
        out[STEP_TIMES] = sorted(k for k in seen if k.startswith("timing_s/"))
        return out

    def columns(self) -> list[str]:
        keys = [k for keys in self.charts().values() for k in keys]
        return ["iteration", *keys, *(k + SMOOTHED for k in keys)]

    def csv(self) -> str:
        """The numbers the charts show (raw and smoothed), one line per iteration."""
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=self.columns(), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(self.rows)
        return out.getvalue()

    def data(self) -> dict:
        """{chart: {metric: (iterations, values)}}, plus "step times" from timing_s/*."""
        its = [m.get("iteration", i + 1) for i, m in enumerate(self.history)]
        out = {}
        for chart, keys in self.charts().items():
            out[chart] = {
                k: ([it for it, m in zip(its, self.history) if k in m], [m[k] for m in self.history if k in m])
                for k in keys
            }
        return out

    def summary(self) -> str:
        if not self.history:
            return "no iterations yet"
        last = self.history[-1]
        shown = [
            k
            for k in ("critic/score/mean", "actor/pg_loss", "response_length/mean", "perf/throughput", "timing_s/step")
            if k in last
        ]
        return escape(
            f"iteration {last.get('iteration', len(self.history)):g}: "
            + "  ".join(f"{_short(k)}={last[k]:.4g}" for k in shown)
        )

    def drawn(self) -> bool:
        return bool(self.history)

    # ---- the live figure ---------------------------------------------------------------------------
    def figure(self) -> FigureParts:
        from bokeh.models import CustomJSTransform, DataRange1d, HoverTool, Row
        from bokeh.transform import transform

        iterations = DataRange1d(name="metrics_iterations", range_padding=0.02)
        # Lines for every metric an algorithm may report are made now, hidden, and shown when
        # their first value arrives: adding renderers to a displayed document costs ~0.5 s,
        # showing one costs a property change.
        expected = {chart: list(keys) for chart, keys in CHARTS.items()}
        expected[STEP_TIMES] = [f"timing_s/{step.name}" for step in steps.STEPS] + ["timing_s/step"]
        figures = {chart: _chart(chart, iterations) for chart in expected}
        lines: dict[str, list] = {}  # metric -> its line, its dots and its legend item
        stream = plots.Stream(_source_columns(expected), list(self.rows), name="metrics")
        # Smoothing runs in the browser over the raw column (the same debiased EMA as `rows`):
        # a new weight is one property change, and each iteration streams only raw values.
        ema = CustomJSTransform(args={"weight": self.smoothing}, v_func=EMA_JS, name="metrics_smoothing")

        def add(chart: str, key: str) -> None:
            fig = figures[chart]
            colour = COLOURS[len([k for k in lines if k in expected[chart]]) % len(COLOURS)]
            label = _short(key)
            line = fig.line(
                "iteration",
                transform(key, ema),
                source=stream.source,
                color=colour,
                line_width=2,
                legend_label=label,
                name=key,  # the chart's one hover tool reads the raw value by it (@$name)
            )
            dots = fig.scatter("iteration", key, source=stream.source, color=colour, alpha=0.3, legend_label=label)
            for renderer in (line, dots):  # the browser derives these: fewer models to sync per update
                renderer.nonselection_glyph = renderer.muted_glyph = "auto"
            tool = fig.select_one({"type": HoverTool})
            tool.renderers = [*tool.renderers, line]
            item = next(i for i in fig.legend[0].items if i.label.value == label)
            line.visible = dots.visible = item.visible = False
            lines[key] = [line, dots, item]
            if key not in expected[chart]:
                expected[chart].append(key)

        for chart, keys in expected.items():
            for key in list(keys):
                add(chart, key)
            plots.legend_outside(figures[chart], "below", ncols=4 if chart == STEP_TIMES else 3)
        version = self.version
        shown = [-1]  # metric names seen when lines were last shown

        def update() -> None:
            nonlocal version
            grew = len(self._seen) != shown[0]  # a metric name not seen before: lines to show
            present = self.charts() if grew else {}
            new = [(chart, k) for chart, keys in present.items() for k in keys if k not in lines]
            if new:  # a metric no chart expected: add its line (rare)
                with plots.frozen(figures[STEP_TIMES]):
                    for chart, key in new:
                        add(chart, key)
                stream.columns = _source_columns(expected)
            if ema.args["weight"] != self.smoothing:
                ema.args = {"weight": self.smoothing}
            if new or version != self.version:
                version = self.version
                stream.reset(list(self.rows))
            else:
                stream.rows.extend(self.rows[stream.sent :])
                stream.send()
            if not grew:
                return
            shown[0] = len(self._seen)
            for chart, keys in present.items():
                for key in keys:  # first values of a metric: show its line and legend entry
                    if not lines[key][0].visible:
                        for part in lines[key]:
                            part.visible = True
                visible = bool(keys) or not self.history  # the charts of metrics this run reports
                if figures[chart].visible != visible:
                    figures[chart].visible = visible

        update()
        # A wrapping row: charts of metrics a run does not report hide without leaving holes.
        grid = Row(children=list(figures.values()), styles={"flex-wrap": "wrap"}, sizing_mode="stretch_width")
        return grid, update

    # ---- the static picture ------------------------------------------------------------------------
    def draw(self, fig: Figure) -> None:
        d = self.data()
        axes = fig.subplots(2, 4).ravel()
        for ax, (chart, series) in zip(axes, d.items()):
            for key, (x, y) in series.items():
                ax.plot(x, y, marker=".", label=_short(key))
            ax.set_title(chart, fontsize=9)
            ax.tick_params(labelsize=7)
            if len(series) > 1:
                ax.legend(fontsize=6)
        for ax in axes[len(d) :]:
            ax.set_axis_off()
        fig.subplots_adjust(**self.margins)


def _chart(title: str, iterations):
    from bokeh.models import BasicTicker

    many = title == STEP_TIMES  # a dozen steps: twice as wide, for its legend
    fig = plots.new_figure(
        title,
        x_range=iterations,  # one iteration axis: zoom one chart, all follow
        height=330 if many else 290,
        width=830 if many else 410,
        sizing_mode="fixed",
        tools="xpan,xwheel_zoom,box_zoom,reset,save",
        active_scroll=None,
        x_axis_label="iteration",
    )
    fig.xaxis.ticker = BasicTicker(min_interval=1)  # iterations are whole
    # One hover tool per chart, for all its lines (each names its metric column).
    plots.hover(fig, [], [("iteration", "@iteration"), ("$name", "@$name{0.0000}")], mode="vline")
    return fig


def _source_columns(charts: dict[str, list[str]]) -> list[str]:
    return ["iteration", *(k for keys in charts.values() for k in keys)]


def _short(key: str) -> str:
    """critic/score/mean -> score/mean, actor/pg_loss -> pg_loss, timing_s/gen -> gen."""
    parts = key.split("/")
    return "/".join(parts[-2:]) if parts[-1] == "mean" else parts[-1]


def ema_step(state: tuple[float, float], value: float, weight: float) -> tuple[float, float]:
    """One point of the debiased exponential moving average (TensorBoard's: early points are not
    pulled towards zero): the new (total, norm) after `value`; the smoothed value is total / norm.
    A non-finite value leaves it as it was."""
    total, norm = state
    if math.isfinite(value):
        total, norm = weight * total + (1 - weight) * value, weight * norm + (1 - weight)
    return total, norm


def smoothing_control(value: float) -> Control:
    """The smoothing slider of the views that draw metrics over iterations."""
    return Control(
        "smoothing",
        "smoothing",
        "float",
        (0.0, 0.95, 0.05),
        value,
        "weight of earlier iterations in each line (exponential moving average, as in TensorBoard); "
        "0 draws the raw values, which stay as faint dots",
    )


def _check_smoothing(value, owner: str = "MetricsDashboard") -> None:
    if not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{owner}: smoothing must be a number in [0, 1), got {value!r}")
