"""What every view shares: controls declared once, and one interactive Bokeh figure shown by
ipywidgets in notebooks (through jupyter_bokeh) and by panel in the app.

A view subclasses `View`: it declares `controls()`, keeps its state, computes `data()` (plain
Python: what the figure shows, testable without a browser) and writes a `summary()` line. Its
`figure()` builds fresh Bokeh models (every front end needs its own) and an update function
that brings them up to date: live views stream new rows into their ColumnDataSources instead
of redrawing, so an update costs milliseconds and happens on every change (the timeline,
whose refresh drains the workers' trace, does it on its own thread after each iteration of a
`fit`). `draw(fig)` paints the same data with matplotlib: the static fallback (`png()`), which
a notebook's output carries beside the live widget so a saved notebook still shows a figure.

    view                 # a notebook cell's value: the live widget (+ a PNG for saved notebooks)
    view.widget()        # the ipywidgets form (controls, summary, figure)
    view.panel()         # the panel form (served by `python -m workbench app`)
    view.html()          # a standalone interactive HTML page (Bokeh, resources inline)
"""

from __future__ import annotations

import base64
import html
import io
import time
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
    """'int' (a slider over `options`: (low, high, step)), 'float' (the same, real-valued),
    'choice' (a dropdown over `options`: a list, or a dict label -> value) or 'steps' (a slider
    over the listed `options`)."""
    options: Any
    value: Any
    help: str = ""
    """What it does, in a sentence: shown as the control's tooltip."""
    visible: bool = True
    """False hides it (e.g. the custom placement's choices while another placement is on)."""


KINDS = ("int", "float", "choice", "steps")


@dataclass(frozen=True)
class Action:
    """A download a view offers (e.g. the dashboard's CSV export)."""

    label: str
    filename: str
    content: Callable[[], str]
    """The file's text, made when asked."""


FigureParts = tuple[Any, Callable[[], None]]
"""A Bokeh layout and the function that brings it up to date with its view."""


class View:
    """Base of the views: settings, figure data, live figure, summary, and their front ends."""

    width, height = 9.0, 3.2
    """Size in inches of the static (matplotlib) figure."""
    margins = {"left": 0.2, "right": 0.98, "top": 0.9, "bottom": 0.15, "wspace": 0.5, "hspace": 0.5}
    """Fixed figure margins (matplotlib's tight_layout costs more than the drawing)."""
    has_figure = True
    """False for views that are all HTML (summary() carries everything)."""
    background_share = 0.01
    """Unused: views stream their updates instead of redrawing on a thread (kept for old code)."""

    def __init__(self):
        self._listeners: list[Callable[[], None]] = []
        self.redraw_seconds: list[float] = []
        """How long each update of the displayed front ends took (summaries and figure data)."""

    def controls(self) -> list[Control]:
        return []

    def set(self, **values) -> None:
        """Change settings (control names) and recompute."""
        raise NotImplementedError

    def data(self) -> dict:
        raise NotImplementedError

    def figure(self) -> FigureParts:
        """Fresh Bokeh models showing `data()`, and their update function."""
        raise NotImplementedError

    def draw(self, fig: Figure) -> None:
        """The static fallback: the same data with matplotlib."""
        raise NotImplementedError

    def summary(self) -> str:
        """A short HTML fragment shown above the figure."""
        return ""

    def drawn(self) -> bool:
        """Whether the static figure would show anything yet (a dashboard shown before its run
        has no iterations: a saved notebook then shows the summary, not empty axes)."""
        return True

    def actions(self) -> list[Action]:
        """Downloads offered beside the controls."""
        return []

    def below(self) -> View | None:
        """Another view shown under the figure (the timeline: the batch of the span clicked)."""
        return None

    def changed(self, background: bool = False) -> None:
        """Bring every displayed front end up to date, now. (`background` is accepted for old
        callers: updates stream rows into the figures' sources, cheap enough for any thread.)"""
        if not self._listeners:
            return
        t0 = time.perf_counter()
        for listener in list(self._listeners):
            listener()
        self.redraw_seconds.append(time.perf_counter() - t0)

    def wait_drawn(self, timeout: float = 30.0) -> bool:
        """Kept for old callers: updates happen when asked, so there is nothing to wait for."""
        return True

    # ---- static output -----------------------------------------------------------------------------
    def png(self, dpi: int = 80) -> bytes:
        fig = Figure(figsize=(self.width, self.height), dpi=dpi)
        self.draw(fig)
        out = io.BytesIO()
        fig.savefig(out, format="png")
        return out.getvalue()

    def html(self, title: str | None = None) -> str:
        """A standalone page: summary and the interactive figure (zoom, hover) with Bokeh's
        resources inline, so it opens offline (no server: clicks that ask Python do nothing)."""
        from bokeh.embed import file_html
        from bokeh.layouts import column
        from bokeh.models import Div
        from bokeh.resources import INLINE

        parts = [Div(text=self.summary(), sizing_mode="stretch_width")]
        if self.has_figure:
            parts.append(self.figure()[0])
        page = column(*parts, sizing_mode="stretch_width")
        return file_html(page, INLINE, title=title or type(self).__name__, suppress_callback_warning=True)

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        """A cell's value: the live widget, with a PNG and the summary beside it for front ends
        without the widget (a saved notebook on a web page, nbconvert): the figure stays visible."""
        bundle = dict(self.widget()._repr_mimebundle_(include=include, exclude=exclude) or {})
        bundle["text/html"] = self.summary()
        if self.has_figure and self.drawn():
            picture = base64.b64encode(self.png()).decode()
            bundle["text/html"] += f"<br><img src='data:image/png;base64,{picture}'>"
            bundle["image/png"] = picture
        return bundle

    # ---- ipywidgets ------------------------------------------------------------------------------
    def widget(self):
        """Controls, summary and live figure as ipywidgets (the figure through jupyter_bokeh)."""
        import ipywidgets as w

        boxes = {}
        for c in self.controls():
            boxes[c.name] = box = _ipywidget(w, c)
            box.observe(lambda change, name=c.name: self.set(**{name: change["new"]}), names="value")
        text = w.HTML(self.summary())
        if self.has_figure:
            from widgets.jupyter import BokehWidget

            layout, update = self.figure()
            plot = BokehWidget(layout)
        else:
            plot, update = w.HTML(""), None
        under = w.VBox([])
        shown: list = [None]

        def refresh():
            text.value = self.summary()
            for c in self.controls():
                if c.name in boxes:
                    boxes[c.name].layout.display = None if c.visible else "none"
            if update is not None:
                with plot.one_patch():  # the update's changes as one message to the browser
                    update()
            view = self.below()
            if view is not shown[0]:
                shown[0] = view
                under.children = [] if view is None else [view.widget()]

        self._listeners.append(refresh)
        controls = (
            w.GridBox(list(boxes.values()), layout=w.Layout(grid_template_columns="repeat(3, 1fr)"))
            if boxes
            else w.HTML("")
        )
        downloads = [_ipy_download(w, a) for a in self.actions()]
        if downloads:
            controls = w.VBox([controls, w.HBox(downloads)])
        return w.VBox([controls, text, plot, under])

    # ---- panel -------------------------------------------------------------------------------------
    def panel(self):
        """The same view as a panel layout (served by `python -m workbench app`)."""
        import panel as pn

        boxes = {}
        for c in self.controls():
            box, boxes[c.name] = _panel_widget(pn, c)
            box.param.watch(lambda event, name=c.name: self.set(**{name: event.new}), "value")
            boxes[c.name].visible = c.visible
        text = pn.pane.HTML(self.summary(), sizing_mode="stretch_width")
        if self.has_figure:
            layout, update = self.figure()
            plot = pn.pane.Bokeh(layout, sizing_mode="stretch_width")
        else:
            plot, update = pn.Spacer(height=0), None
        under = pn.Column(sizing_mode="stretch_width")
        shown: list = [None]

        def refresh():
            text.object = self.summary()
            for c in self.controls():
                if c.name in boxes:
                    boxes[c.name].visible = c.visible
            if update is not None:
                update()
                pn.io.push_notebook(plot)  # shown in a notebook: send the changed models (served: no-op)
            view = self.below()
            if view is not shown[0]:
                shown[0] = view
                under.objects = [] if view is None else [view.panel()]

        self._listeners.append(refresh)
        inputs = pn.GridBox(*boxes.values(), ncols=3) if boxes else pn.Spacer(height=0)
        downloads = [
            pn.widgets.FileDownload(
                callback=lambda a=a: io.BytesIO(a.content().encode()), filename=a.filename, label=a.label
            )
            for a in self.actions()
        ]
        if downloads:
            inputs = pn.Row(inputs, *downloads)
        return pn.Column(inputs, text, plot, under, sizing_mode="stretch_width")


def _ipywidget(w, c: Control):
    if c.kind in ("int", "float"):
        low, high, step = c.options
        kind = w.IntSlider if c.kind == "int" else w.FloatSlider
        box = kind(value=c.value, min=low, max=high, step=step, description=c.label, continuous_update=False)
    elif c.kind == "steps":
        box = w.SelectionSlider(
            options=_with(c.options, c.value), value=c.value, description=c.label, continuous_update=False
        )
    elif c.kind == "choice":
        options = list(c.options.items()) if isinstance(c.options, dict) else list(c.options)
        box = w.Dropdown(options=options, value=c.value, description=c.label)
    else:
        raise ValueError(f"Control {c.name!r}: kind {c.kind!r} is not one of {KINDS}")
    box.style.description_width = "initial"
    box.tooltip = c.help or None
    box.layout.display = None if c.visible else "none"
    return box


def _ipy_download(w, action: Action):
    """A button that turns into a download link of the file made at the click."""
    button, link = w.Button(description=action.label), w.HTML("")

    def make(_):
        data = base64.b64encode(action.content().encode()).decode()
        link.value = f"<a download='{action.filename}' href='data:text/plain;base64,{data}'>{action.filename}</a>"

    button.on_click(make)
    return w.HBox([button, link])


def _panel_widget(pn, c: Control):
    """The control's panel widget, and what the layout shows: sliders have no tooltip of their
    own, so a TooltipIcon beside them carries the help."""
    if c.kind in ("int", "float"):
        low, high, step = c.options
        kind = pn.widgets.IntSlider if c.kind == "int" else pn.widgets.FloatSlider
        box = kind(label=c.label, start=low, end=high, step=step, value=c.value)
    elif c.kind == "steps":
        box = pn.widgets.DiscreteSlider(label=c.label, options=_with(c.options, c.value), value=c.value)
    elif c.kind == "choice":
        options = dict(c.options) if isinstance(c.options, dict) else list(c.options)
        return (
            box := pn.widgets.Select(label=c.label, options=options, value=c.value, description=c.help or None)
        ), box
    else:
        raise ValueError(f"Control {c.name!r}: kind {c.kind!r} is not one of {KINDS}")
    shown = pn.Row(box, pn.widgets.TooltipIcon(value=c.help), visible=c.visible) if c.help else box
    return box, shown


def _with(options, value) -> list:
    """A slider's steps, with the current value among them (a scenario may start between steps)."""
    return sorted({*options, value}) if value not in options else list(options)


def escape(text: Any) -> str:
    return html.escape(str(text))
