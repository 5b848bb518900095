"""Bokeh pieces the views share: a figure styled for reading (fonts a size up, legends outside
the data), and streaming of a view's growing rows into a ColumnDataSource.

Everything interactive is Bokeh's own: pan and zoom tools, HoverTool tooltips, TapTool
selection (a Python callback on `source.selected`), ranges shared between figures.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from bokeh.models import ColumnDataSource, HoverTool, Legend
from bokeh.plotting import figure

FONT = "11pt"
SMALL = "10pt"


def new_figure(title: str = "", **kwargs: Any):
    """A figure with readable fonts and the toolbar on the right."""
    kwargs.setdefault("toolbar_location", "right")
    kwargs.setdefault("sizing_mode", "stretch_width")
    fig = figure(title=title, **kwargs)
    fig.title.text_font_size = FONT
    for axis in (*fig.xaxis, *fig.yaxis):
        axis.major_label_text_font_size = SMALL
        axis.axis_label_text_font_size = SMALL
        axis.axis_label_text_font_style = "normal"
    fig.toolbar.logo = None
    fig.toolbar.autohide = True  # tools show when the pointer is over the figure
    return fig


def legend_outside(fig, where: str = "below", ncols: int | None = None) -> None:
    """Move the figure's legend out of the data area (in `ncols` columns); a click on an entry
    hides its line."""
    legend = next((c for c in fig.center if isinstance(c, Legend)), None)
    if legend is None:  # none yet, or already moved (new lines join the moved one)
        return
    fig.center = [c for c in fig.center if not isinstance(c, Legend)]
    legend.location = "center" if where in ("right", "left") else "top_left"
    legend.orientation = "vertical" if where in ("right", "left") else "horizontal"
    if ncols:
        legend.ncols = ncols
    legend.label_text_font_size = SMALL
    legend.click_policy = "hide"
    legend.spacing = 8
    legend.border_line_alpha = 0
    legend.margin, legend.padding = 2, 2
    fig.add_layout(legend, where)


def hover(fig, renderers: list, tooltips: list[tuple[str, str]], **kwargs: Any) -> HoverTool:
    tool = HoverTool(renderers=renderers, tooltips=tooltips, **kwargs)
    fig.add_tools(tool)
    return tool


class Stream:
    """A ColumnDataSource fed from a view's growing list of rows (dicts): `send()` streams the
    rows it has not sent yet, so each front end costs only the new rows."""

    def __init__(self, columns: list[str], rows: list[dict], rollover: int | None = None, name: str | None = None):
        self.columns, self.rows, self.rollover = columns, rows, rollover
        self.sent = len(rows)
        start = rows[-rollover:] if rollover else rows
        self.source = ColumnDataSource(self._columns(start), name=name)

    def _columns(self, rows: list[dict]) -> dict[str, list]:
        return {c: [r.get(c) for r in rows] for c in self.columns}

    def send(self) -> int:
        """Stream the new rows; returns how many."""
        new = self.rows[self.sent :]
        if new:
            self.source.stream(self._columns(new), rollover=self.rollover)
            self.sent = len(self.rows)
        return len(new)

    def reset(self, rows: list[dict]) -> None:
        """Replace everything (the view's rows were rebuilt)."""
        self.rows = rows
        self.sent = len(rows)
        self.source.data = self._columns(rows[-self.rollover :] if self.rollover else rows)


@contextlib.contextmanager
def frozen(model) -> Iterator[None]:
    """Change a displayed figure's model graph (add renderers, annotations) in one go: without
    it Bokeh re-walks the whole document after every change (~0.1 s each when lines are added
    to a dashboard); with it, once at the end. Only for structural changes: leaving the block
    always re-walks, and streaming rows needs none of it."""
    document = model.document
    if document is None:
        yield
        return
    with document.models.freeze():
        yield
