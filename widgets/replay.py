"""ReplayView: one batch's replay (algorithms.replay) side by side.

    result = grpo.replay(batch, {"grpo": {}, "dr_grpo": {...}, "gspo": {...}})
    ReplayView(result, tokenizer)      # in a notebook: the table and the figures
    view.set(row=3)                    # another sample's per-token advantages

The summary is the replay's table: per variant its changes, advantages, loss terms, clip
fraction, gradient and update norms (and KL to the current policy). Left: the cosines between the
variants' update directions. Right: one sample's per-token advantages under each variant, over
its response tokens.
"""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from algorithms.replay import ReplayResult, format_cell
from widgets import plots
from widgets.ui import Control, FigureParts, View, escape

PALETTE = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")


class ReplayView(View):
    """A replay's table, the cosines between its variants' updates, and per-token advantages."""

    width, height = 10.0, 3.6
    margins = {"left": 0.12, "right": 0.98, "top": 0.9, "bottom": 0.22, "wspace": 0.45, "hspace": 0.3}

    def __init__(self, result: ReplayResult, tokenizer=None, batch=None, row: int = 0):
        """tokenizer and batch (the replayed one): the sample's response tokens as text."""
        super().__init__()
        if not isinstance(result, ReplayResult):
            raise ValueError(f"ReplayView shows what algo.replay(...) returned, got {type(result).__name__}")
        self.result, self.tokenizer, self.batch = result, tokenizer, batch
        self.row = self._checked_row(row)

    def _checked_row(self, row) -> int:
        rows = len(self.result.response_mask)
        if not isinstance(row, int) or not 0 <= row < rows:
            raise ValueError(f"ReplayView: row {row!r} is not a sample of the batch; use 0..{rows - 1}")
        return row

    def controls(self) -> list[Control]:
        rows = len(self.result.response_mask)
        return [Control("row", "sample", "int", (0, rows - 1, 1), self.row, "the sample whose advantages are drawn")]

    def set(self, **values) -> None:
        unknown = set(values) - {"row"}
        if unknown:
            raise ValueError(f"ReplayView.set: unknown settings {sorted(unknown)}; it has 'row'")
        if "row" in values:
            self.row = self._checked_row(values["row"])
        self.changed()

    # ---- data --------------------------------------------------------------------------------
    def tokens(self) -> list[str]:
        """The shown sample's response tokens as text (positions when there is no tokenizer)."""
        length = int(self.result.response_mask[self.row].sum())
        if self.tokenizer is None or self.batch is None or "responses" not in self.batch:
            return [str(i) for i in range(length)]
        ids = self.batch["responses"][self.row][:length].tolist()
        return [self.tokenizer.decode([i]) for i in ids]

    def advantages(self) -> dict[str, list[float]]:
        """Each variant's advantages over the shown sample's response tokens."""
        valid = self.result.response_mask[self.row].bool()
        return {name: self.result.advantages[name][self.row][valid].tolist() for name in self.result.names}

    def data(self) -> dict:
        return {
            "table": self.result.table(),
            "cosines": self.result.cosines(),
            "row": self.row,
            "tokens": self.tokens(),
            "advantages": self.advantages(),
        }

    def summary(self) -> str:
        rows = self.result.table()
        columns = list(rows[0])
        head = "".join(f"<th>{escape(c)}</th>" for c in columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{escape(format_cell(row[c]))}</td>" for c in columns) + "</tr>" for row in rows
        )
        return f"<table><tr>{head}</tr>{body}</table>"

    # ---- the live figure ---------------------------------------------------------------------
    def figure(self) -> FigureParts:
        from bokeh.models import ColumnDataSource, LinearColorMapper, Row

        names = self.result.names
        cosines = self.result.cosines()
        cells = {
            "a": [a for a in names for _ in names],
            "b": [b for _ in names for b in names],
            "cos": [cosines[a][b] for a in names for b in names],
            "label": [f"{cosines[a][b]:.2f}" for a in names for b in names],
            "ink": ["white" if abs(cosines[a][b]) > 0.5 else "black" for a in names for b in names],
        }
        heat = plots.new_figure(
            "cosine between update directions",
            x_range=names,
            y_range=list(reversed(names)),
            height=320,
            width=420,
            sizing_mode="fixed",
        )
        colours = LinearColorMapper(palette="RdBu11", low=-1, high=1)
        squares = heat.rect(
            "a", "b", 1, 1, source=ColumnDataSource(cells), fill_color={"field": "cos", "transform": colours}
        )
        heat.text(
            "a",
            "b",
            text="label",
            source=ColumnDataSource(cells),
            text_align="center",
            text_baseline="middle",
            text_color="ink",
        )
        heat.xaxis.major_label_orientation = math.pi / 4
        plots.hover(heat, [squares], [("variants", "@a / @b"), ("cosine", "@cos{0.0000}")])
        per_token = plots.new_figure(
            "advantages over the sample's response tokens", height=320, width=560, sizing_mode="fixed"
        )
        source = ColumnDataSource(self._token_columns())
        drawn = []
        for name, colour in zip(names, _colours(len(names))):
            drawn.append(per_token.line("position", name, source=source, color=colour, line_width=2, legend_label=name))
        plots.hover(per_token, drawn, [("token", "@token"), ("position", "@position"), ("advantage", "$y{0.000}")])
        plots.legend_outside(per_token, "right")

        def update() -> None:
            source.data = self._token_columns()
            per_token.title.text = f"sample {self.row}: advantages over its response tokens"

        update()
        return Row(children=[heat, per_token]), update

    def _token_columns(self) -> dict[str, list]:
        advantages = self.advantages()
        tokens = self.tokens()
        return {"position": list(range(len(tokens))), "token": tokens, **advantages}

    # ---- the static picture ------------------------------------------------------------------
    def draw(self, fig: Figure) -> None:
        left, right = fig.subplots(1, 2)
        names = self.result.names
        cosines = self.result.cosines()
        grid = [[cosines[a][b] for b in names] for a in names]
        left.imshow(grid, cmap="RdBu", vmin=-1, vmax=1)
        for i, a in enumerate(names):
            for j, b in enumerate(names):
                ink = "white" if abs(cosines[a][b]) > 0.5 else "black"  # readable on the dark ends
                left.text(j, i, f"{cosines[a][b]:.2f}", ha="center", va="center", fontsize=7, color=ink)
        left.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
        left.set_yticks(range(len(names)), names, fontsize=7)
        left.set_title("cosine between update directions", fontsize=9)
        for (name, values), colour in zip(self.advantages().items(), _colours(len(names))):
            right.plot(range(len(values)), values, color=colour, marker=".", label=name)
        right.axhline(0, color="#999999", linewidth=0.5)
        right.set_title(f"sample {self.row}: advantages over its response tokens", fontsize=9)
        right.set_xlabel("response token", fontsize=8)
        right.legend(fontsize=7)
        right.tick_params(labelsize=7)
        fig.subplots_adjust(**self.margins)


def _colours(n: int) -> list[str]:
    return [PALETTE[i % len(PALETTE)] for i in range(n)]
