"""MismatchView: where the rollout's log-probs and the trainer's disagree, iteration by iteration.

    view = MismatchView(tokenizer)                        # in a notebook: the figures
    grpo.fit(prompts, 10, callbacks=[view])               # one batch measured per iteration
    view.set(iteration=3)                                  # the histogram and tables of iteration 3

Left: quantiles of |rollout - trainer| per iteration (median, 90%, 99%, largest) on a log axis,
with their mean, which is `actor/rollout_logprob_diff`. Right: the chosen iteration's
distribution. The summary lists that batch's tokens most off (row, position, text, both
log-probs, ratio) and what each off-policy cap would do to it (algorithms.mismatch). The batch
inspector colours tokens by the same difference (field "mismatch (rollout - trainer)").
Needs the trainer's own log-probs: run with old_log_probs="recompute".
"""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from algorithms.mismatch import CAPS, Mismatch, mismatch
from widgets import plots
from widgets.ui import Control, FigureParts, View, escape

QUANTILES = {0.5: "median", 0.9: "90%", 0.99: "99%", 1.0: "largest"}
COLOURS = {"median": "#4c72b0", "90%": "#dd8452", "99%": "#c44e52", "largest": "#8172b3", "mean": "#55a868"}
FLOOR = 1e-8
"""Where exact agreement is drawn on the log axes."""


class MismatchView(View):
    """Per-iteration mismatch between the rollout's and the trainer's log-probs."""

    width, height = 10.0, 3.4
    margins = {"left": 0.07, "right": 0.98, "top": 0.88, "bottom": 0.16, "wspace": 0.25, "hspace": 0.3}

    def __init__(self, tokenizer=None, worst: int = 8, caps: tuple[float, ...] = CAPS, keep: int = 50):
        """worst: how many of the tokens most off to list; caps: the off-policy caps to weigh;
        keep: how many iterations' batches to hold (their quantiles stay for every iteration)."""
        super().__init__()
        if not isinstance(worst, int) or worst < 1 or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"MismatchView: worst={worst!r} and keep={keep!r} must be whole numbers >= 1")
        self.tokenizer, self.worst_k, self.caps_shown, self.keep = tokenizer, worst, tuple(caps), keep
        self.held: dict[int, Mismatch] = {}
        self.rows: list[dict] = []
        """One per iteration: its quantiles of |diff| and the mean."""
        self.iteration: int | None = None
        """The iteration the histogram and tables show (None: the latest)."""

    def __call__(self, algorithm=None, batch=None, metrics=None) -> None:
        """As a `fit` callback."""
        if batch is None:
            return
        iteration = int(metrics["iteration"]) if metrics and "iteration" in metrics else len(self.rows) + 1
        self.add(batch, iteration)

    def add(self, batch, iteration: int) -> Mismatch:
        """Measure one batch (replacing an earlier one of the same iteration: a redo)."""
        m = mismatch(batch, iteration)
        self.held[iteration] = m
        for old in sorted(self.held)[: max(0, len(self.held) - self.keep)]:
            del self.held[old]
        row = {"iteration": iteration, "mean": m.mean_abs()}
        row |= {name: q for name, q in zip(QUANTILES.values(), m.quantiles(QUANTILES).values())}
        self.rows = [r for r in self.rows if r["iteration"] != iteration] + [row]
        self.rows.sort(key=lambda r: r["iteration"])
        self.changed()
        return m

    def controls(self) -> list[Control]:
        held = sorted(self.held)
        if not held:
            return []
        return [
            Control("iteration", "iteration", "steps", held, self.shown_iteration(), "the batch shown on the right")
        ]

    def set(self, **values) -> None:
        unknown = set(values) - {"iteration"}
        if unknown:
            raise ValueError(f"MismatchView.set: unknown settings {sorted(unknown)}; it has 'iteration'")
        if "iteration" in values:
            it = values["iteration"]
            if it is not None and it not in self.held:
                raise ValueError(f"MismatchView: iteration {it!r} is not held; held: {sorted(self.held)}")
            self.iteration = it
        self.changed()

    def shown_iteration(self) -> int | None:
        if self.iteration in self.held:
            return self.iteration
        return max(self.held) if self.held else None

    def shown(self) -> Mismatch | None:
        it = self.shown_iteration()
        return None if it is None else self.held[it]

    # ---- data --------------------------------------------------------------------------------
    def histogram(self) -> dict[str, list]:
        """The shown iteration's |diff| in log bins: edges and counts."""
        m = self.shown()
        edges, counts = m.histogram() if m is not None else ([], [])
        return {"edges": edges, "counts": counts}

    def data(self) -> dict:
        m = self.shown()
        return {
            "per_iteration": list(self.rows),
            "iteration": self.shown_iteration(),
            "histogram": self.histogram(),
            "worst": m.worst(self.worst_k, self.tokenizer) if m is not None else [],
            "caps": m.caps(self.caps_shown) if m is not None else [],
        }

    def drawn(self) -> bool:
        return bool(self.rows)

    def summary(self) -> str:
        d = self.data()
        if d["iteration"] is None:
            return "no batch measured yet"
        last = next(r for r in d["per_iteration"] if r["iteration"] == d["iteration"])
        if last["largest"] == 0:
            return (
                f"iteration {d['iteration']}: the trainer's log-probs are the rollout's own (every token agrees "
                "exactly): run with old_log_probs='recompute' to measure the mismatch"
            )
        head = (
            f"iteration {d['iteration']}: mean |rollout - trainer| {last['mean']:.3g} "
            f"(actor/rollout_logprob_diff), median {last['median']:.3g}, 99% {last['99%']:.3g}, "
            f"largest {last['largest']:.3g}"
        )
        worst = "".join(
            f"<tr><td>{w['row']}</td><td>{w['position']}</td><td><code>{escape(repr(w['text']))}</code></td>"
            f"<td>{w['rollout']:.4f}</td><td>{w['trainer']:.4f}</td><td>{w['diff']:+.3g}</td>"
            f"<td>{w['ratio']:.3g}</td></tr>"
            for w in d["worst"]
        )
        caps = "".join(
            f"<tr><td>{c['cap']:g}</td><td>{c['over']:.2%}</td><td>{c['tis_mean_weight']:.4f}</td>"
            f"<td>{c['decoupled_kept']:.2%}</td></tr>"
            for c in d["caps"]
        )
        return (
            f"<div>{escape(head)}</div><table style='display:inline-block;vertical-align:top'>"
            "<tr><th>row</th><th>pos</th><th>token</th><th>rollout</th><th>trainer</th><th>diff</th>"
            f"<th>ratio</th></tr>{worst}</table> <table style='display:inline-block;vertical-align:top'>"
            "<tr><th>cap</th><th>ratio over it</th><th>TIS mean weight</th><th>decoupled keeps</th></tr>"
            f"{caps}</table>"
        )

    # ---- the live figure ---------------------------------------------------------------------
    def figure(self) -> FigureParts:
        from bokeh.models import ColumnDataSource, Row

        over = plots.new_figure(
            "|rollout - trainer| log-prob per iteration",
            y_axis_type="log",
            height=300,
            width=520,
            sizing_mode="fixed",
            x_axis_label="iteration",
        )
        lines = ColumnDataSource(_columns(self.rows))
        drawn = []
        for name, colour in COLOURS.items():
            dash = "dashed" if name == "mean" else "solid"
            label = "mean (rollout_logprob_diff)" if name == "mean" else name
            drawn.append(
                over.line(
                    "iteration", name, source=lines, color=colour, line_width=2, line_dash=dash, legend_label=label
                )
            )
            over.scatter("iteration", name, source=lines, color=colour, size=4)
        plots.hover(over, drawn, [("iteration", "@iteration"), ("value", "$y{0.[000]e}")])
        plots.legend_outside(over, "right")
        spread = plots.new_figure(
            "its distribution", x_axis_type="log", height=300, width=430, sizing_mode="fixed", x_axis_label="|diff|"
        )
        bars = ColumnDataSource(_bars(self.histogram()))
        spread.quad(left="left", right="right", top="count", bottom=0, source=bars, color="#4c72b0", alpha=0.7)
        plots.hover(spread, [], [("|diff|", "@left{0.[00]e} to @right{0.[00]e}"), ("tokens", "@count")])

        def update() -> None:
            lines.data = _columns(self.rows)
            bars.data = _bars(self.histogram())
            it = self.shown_iteration()
            spread.title.text = f"iteration {it}: tokens by |diff|" if it is not None else "its distribution"

        update()
        return Row(children=[over, spread]), update

    # ---- the static picture ------------------------------------------------------------------
    def draw(self, fig: Figure) -> None:
        left, right = fig.subplots(1, 2)
        its = [r["iteration"] for r in self.rows]
        for name, colour in COLOURS.items():
            values = [max(r[name], FLOOR) for r in self.rows]
            left.plot(its, values, "--" if name == "mean" else "-", color=colour, marker=".", label=name)
        left.set_yscale("log")
        left.set_title("|rollout - trainer| log-prob per iteration", fontsize=9)
        left.set_xlabel("iteration", fontsize=8)
        left.legend(fontsize=7)
        hist = self.histogram()
        if hist["counts"]:
            edges = hist["edges"]
            right.bar(edges[:-1], hist["counts"], width=[b - a for a, b in zip(edges, edges[1:])], align="edge")
            right.set_xscale("log")
        right.set_title(f"iteration {self.shown_iteration()}: tokens by |diff|", fontsize=9)
        for ax in (left, right):
            ax.tick_params(labelsize=7)
        fig.subplots_adjust(**self.margins)


def _columns(rows: list[dict]) -> dict[str, list]:
    # A log axis cannot show 0 (exact agreement): drawn at FLOOR.
    out = {"iteration": [r["iteration"] for r in rows]}
    for name in COLOURS:
        out[name] = [max(r[name], FLOOR) if math.isfinite(r[name]) else None for r in rows]
    return out


def _bars(histogram: dict) -> dict[str, list]:
    edges, counts = histogram["edges"], histogram["counts"]
    return {"left": edges[:-1], "right": edges[1:], "count": counts}
