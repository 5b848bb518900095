"""What every view shares: controls declared once, shown as ipywidgets or panel widgets, and a
matplotlib figure rendered to PNG (an image widget updates cleanly in notebooks, under nbval,
and in a served panel app alike).

A view subclasses `View`: it declares `controls()`, keeps its state, computes `data()` (plain
Python: what the figure shows, testable without a browser), `draw(fig)`s it and writes a
`summary()` line. `view.widget()` is the ipywidgets form, `view.panel()` the panel form.
"""

from __future__ import annotations

import html
import io
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from matplotlib.figure import Figure

ROLE_COLOURS = {
    "actor": "#4c72b0",
    "reference": "#8c8c8c",
    "critic": "#dd8452",
    "reward": "#55a868",
    "cost": "#c44e52",
    "cost_critic": "#937860",
}
PALETTE = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]


def role_colour(role: str) -> str:
    return ROLE_COLOURS.get(role) or PALETTE[sum(map(ord, role)) % len(PALETTE)]


@dataclass(frozen=True)
class Control:
    """One input of a view."""

    name: str
    """The view's setting it changes."""
    label: str
    kind: str
    """'int' (a slider over `options`: (low, high, step)), 'choice' (a dropdown over `options`)
    or 'steps' (a slider over the listed `options`)."""
    options: Any
    value: Any


class View:
    """Base of the views: settings, figure data, figure, summary, and their two front ends."""

    width, height = 9.0, 3.2
    margins = {"left": 0.2, "right": 0.98, "top": 0.9, "bottom": 0.15, "wspace": 0.5, "hspace": 0.5}
    """Fixed figure margins (matplotlib's tight_layout costs more than the drawing)."""
    has_figure = True
    background_share = 0.01
    """Background redraws take at most this share of wall time: after one that took d seconds,
    the next waits until d / share from its start. A matplotlib figure costs 0.1-0.3 s of CPU,
    which competes with the workers on a small machine; at 0.01 a 0.12 s timeline redraws at
    most every 10 s (every iteration, once iterations take minutes). Raise it for livelier views."""
    """False for views that are all HTML (summary() carries everything)."""

    def __init__(self):
        self._listeners: list[Callable[[], None]] = []
        self._drawing = threading.Lock()  # one redraw at a time, foreground or background
        self._asked = threading.Condition()
        self._redraws_asked = self._redraws_done = 0
        self._drawer: threading.Thread | None = None
        self.redraw_seconds: list[float] = []
        """How long each redraw of the displayed front ends took (summary and figure)."""

    def controls(self) -> list[Control]:
        return []

    def set(self, **values) -> None:
        """Change settings (control names) and recompute."""
        raise NotImplementedError

    def data(self) -> dict:
        raise NotImplementedError

    def draw(self, fig: Figure) -> None:
        raise NotImplementedError

    def summary(self) -> str:
        """A short HTML fragment shown above the figure."""
        return ""

    def changed(self, background: bool = False) -> None:
        """Tell the displayed front ends to redraw: now, or with `background` (a `fit` callback)
        on this view's drawing thread, so rendering the figure stays off the loop's critical
        path; requests that arrive while it draws merge into one redraw of the latest state."""
        if not self._listeners:
            return
        if not background:
            self._redraw()
            return
        with self._asked:
            self._redraws_asked += 1
            if self._drawer is None:
                self._drawer = threading.Thread(
                    target=self._draw_when_asked, name=f"{type(self).__name__} redraw", daemon=True
                )
                self._drawer.start()
            self._asked.notify_all()

    def _draw_when_asked(self) -> None:
        while True:
            with self._asked:
                self._asked.wait_for(lambda: self._redraws_asked > self._redraws_done)
                asked = self._redraws_asked
            start = time.monotonic()
            try:
                self._redraw()
            except Exception as e:  # keep drawing later updates; the loop itself is unaffected
                warnings.warn(f"{type(self).__name__}: redrawing failed: {e!r}", stacklevel=1)
            with self._asked:
                self._redraws_done = asked
                self._asked.notify_all()
            took = time.monotonic() - start
            time.sleep(min(took / self.background_share - took, 10.0))  # requests meanwhile merge

    def _redraw(self) -> None:
        with self._drawing:
            t0 = time.perf_counter()
            for listener in self._listeners:
                listener()
            self.redraw_seconds.append(time.perf_counter() - t0)

    def wait_drawn(self, timeout: float = 30.0) -> bool:
        """Wait until the background redraws asked for so far are done (tests, screenshots)."""
        with self._asked:
            return self._asked.wait_for(lambda: self._redraws_done >= self._redraws_asked, timeout)

    def png(self, dpi: int = 80) -> bytes:
        fig = Figure(figsize=(self.width, self.height), dpi=dpi)
        self.draw(fig)
        out = io.BytesIO()
        fig.savefig(out, format="png")
        return out.getvalue()

    # ---- ipywidgets ------------------------------------------------------------------------------
    def widget(self):
        """Controls, summary and figure as ipywidgets (display it in a notebook cell)."""
        import ipywidgets as w

        inputs = []
        for c in self.controls():
            if c.kind == "int":
                low, high, step = c.options
                box = w.IntSlider(
                    value=c.value, min=low, max=high, step=step, description=c.label, continuous_update=False
                )
            elif c.kind == "steps":
                box = w.SelectionSlider(
                    options=_with(c.options, c.value), value=c.value, description=c.label, continuous_update=False
                )
            else:
                box = w.Dropdown(options=list(c.options), value=c.value, description=c.label)
            box.style.description_width = "initial"
            box.observe(lambda change, name=c.name: self.set(**{name: change["new"]}), names="value")
            inputs.append(box)
        text = w.HTML(self.summary())
        image = w.Image(value=self.png(), format="png") if self.has_figure else w.HTML("")

        def redraw():
            text.value = self.summary()
            if self.has_figure:
                image.value = self.png()

        self._listeners.append(redraw)
        controls = w.GridBox(inputs, layout=w.Layout(grid_template_columns="repeat(3, 1fr)")) if inputs else w.HTML("")
        return w.VBox([controls, text, image])

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget())

    # ---- panel -------------------------------------------------------------------------------------
    def panel(self):
        """The same view as a panel layout (served by `python -m workbench app`)."""
        import panel as pn

        inputs = []
        for c in self.controls():
            if c.kind == "int":
                low, high, step = c.options
                box = pn.widgets.IntSlider(label=c.label, start=low, end=high, step=step, value=c.value)
            elif c.kind == "steps":
                box = pn.widgets.DiscreteSlider(label=c.label, options=_with(c.options, c.value), value=c.value)
            else:
                box = pn.widgets.Select(label=c.label, options=list(c.options), value=c.value)
            box.param.watch(lambda event, name=c.name: self.set(**{name: event.new}), "value")
            inputs.append(box)
        text = pn.pane.HTML(self.summary(), sizing_mode="stretch_width")
        image = pn.pane.PNG(self.png(), width=int(self.width * 80)) if self.has_figure else pn.Spacer(height=0)

        def redraw():
            text.object = self.summary()
            if self.has_figure:
                image.object = self.png()

        self._listeners.append(redraw)
        return pn.Column(pn.GridBox(*inputs, ncols=3) if inputs else pn.Spacer(height=0), text, image)


def _with(options, value) -> list:
    """A slider's steps, with the current value among them (a scenario may start between steps)."""
    return sorted({*options, value}) if value not in options else list(options)


def escape(text: Any) -> str:
    return html.escape(str(text))
