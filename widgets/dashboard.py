"""MetricsDashboard: an algorithm's metrics over iterations, updating while `fit` runs.

    dashboard = MetricsDashboard()
    dashboard                                        # in a notebook: the charts
    ppo.fit(prompts, 10, log=None, callbacks=[dashboard])

Charts: score and rewards, KL, losses, clip fractions, response length, throughput and the
time of each step. A chart shows whichever of its metrics the algorithm reports (verl's
names). `MetricsDashboard.from_jsonl(path)` reads a run's metrics file (RunRecorder's).
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

from widgets.ui import View, escape

CHARTS = {
    "score": ("critic/score/mean", "critic/rewards/mean", "safe/cost/mean"),
    "KL": ("actor/ppo_kl", "actor/reward_kl_penalty", "actor/kl_loss"),
    "losses": ("actor/pg_loss", "critic/vf_loss", "actor/entropy"),
    "clip fractions": ("actor/pg_clipfrac", "critic/vf_clipfrac"),
    "response length": ("response_length/mean",),
    "throughput (tokens/s)": ("perf/throughput",),
}


class MetricsDashboard(View):
    """Charts of metrics dicts, one per iteration."""

    width, height = 10.0, 4.8
    margins = {"left": 0.05, "right": 0.99, "top": 0.93, "bottom": 0.07, "wspace": 0.3, "hspace": 0.35}

    def __init__(self, history: list[dict] | None = None):
        super().__init__()
        self.history: list[dict] = list(history or [])

    @classmethod
    def from_jsonl(cls, path: str | Path) -> MetricsDashboard:
        dashboard = cls()
        dashboard.load(path)
        return dashboard

    def load(self, path: str | Path) -> None:
        """Replace the history with a metrics file's lines (a half-written last line is skipped)."""
        history = []
        if Path(path).exists():
            for line in Path(path).read_text().splitlines():
                try:
                    history.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        self.history = history
        self.changed()

    def update(self, metrics: dict, background: bool = False) -> None:
        """Add one iteration's metrics and redraw (see `View.changed` for `background`)."""
        self.history.append(dict(metrics))
        self.changed(background)

    def __call__(self, algorithm=None, batch=None, metrics=None) -> None:
        """As a `fit` callback: redraw off the loop's critical path."""
        self.update(metrics, background=True)

    def data(self) -> dict:
        """{chart: {metric: (iterations, values)}}, plus "step times" from timing_s/*."""
        its = [m.get("iteration", i + 1) for i, m in enumerate(self.history)]
        out = {}
        for chart, keys in CHARTS.items():
            series = {
                k: ([it for it, m in zip(its, self.history) if k in m], [m[k] for m in self.history if k in m])
                for k in keys
            }
            out[chart] = {k: v for k, v in series.items() if v[0]}
        timings = sorted({k for m in self.history for k in m if k.startswith("timing_s/")})
        out["step times (s)"] = {
            k: ([it for it, m in zip(its, self.history) if k in m], [m[k] for m in self.history if k in m])
            for k in timings
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
            + "  ".join(f"{k.split('/')[-2] if k.endswith('/mean') else k.split('/')[-1]}={last[k]:.4g}" for k in shown)
        )

    def draw(self, fig: Figure) -> None:
        d = self.data()
        axes = fig.subplots(2, 4).ravel()
        for ax, (chart, series) in zip(axes, d.items()):
            for key, (x, y) in series.items():
                ax.plot(x, y, marker=".", label=key.removeprefix("timing_s/"))
            ax.set_title(chart, fontsize=8)
            ax.tick_params(labelsize=6)
            if len(series) > 1:
                ax.legend(fontsize=5)
        for ax in axes[len(d) :]:
            ax.set_axis_off()
        fig.subplots_adjust(**self.margins)
