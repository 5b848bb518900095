"""BatchInspector: browse an iteration's Batch row by row, per-token values shown as colour.

    BatchInspector(batch, tokenizer)          # in a notebook: filters and the coloured rows

Each row shows its prompt, response, score (and cost), and the response's tokens shaded by
one per-token column: log-prob, reference log-prob, KL (old - ref), the rollout's log-prob
minus the trainer's (the training/inference mismatch), value or advantage.
Red is above zero, blue below, the shade scaled by the largest magnitude of that column in
the whole batch, so rows compare. Filter by score, sort by mean advantage. A chat prompt is
shown as its conversation (system, user, then the response as the assistant's turn) rather
than as the template's text.
"""

from __future__ import annotations

import itertools

from widgets.ui import Control, View, escape
from workbench import checks
from workbench.data.prompts import conversation, show_conversation

TOKEN_FIELDS = {
    "advantage": "advantages",
    "log-prob": "old_log_probs",
    "reference log-prob": "ref_log_probs",
    "KL (old - ref)": None,
    "mismatch (rollout - trainer)": None,
    "value": "values",
    "return": "returns",
}
SORTS = ("none", "advantage (high first)", "advantage (low first)", "score (high first)")
OBSERVED = "#e6e6e6"
"""The background of tokens a row holds but is not trained on (a multi-turn row's observations)."""


def shade(value: float, scale: float) -> str:
    """Background colour of a value: white at 0, full red at +scale, full blue at -scale."""
    t = max(-1.0, min(1.0, value / scale)) if scale > 0 else 0.0
    fade = int(round(255 * (1 - abs(t))))
    return f"#ff{fade:02x}{fade:02x}" if t >= 0 else f"#{fade:02x}{fade:02x}ff"


class BatchInspector(View):
    """Rows of a Batch with per-token colour; `rows()` and `tokens(i)` are the data shown."""

    has_figure = False

    def __init__(
        self,
        batch,
        tokenizer=None,
        field: str = "advantage",
        sort: str = "advantage (high first)",
        min_score: float | None = None,
        max_rows: int = 8,
        title: str = "",
    ):
        super().__init__()
        self.batch, self.tokenizer, self.title = batch, tokenizer, title
        self.field, self.sort, self.min_score, self.max_rows = field, sort, min_score, max_rows
        self._check()

    def _check(self) -> None:
        if self.field not in self.fields():
            raise ValueError(f"BatchInspector: field {self.field!r} is not in this batch; available: {self.fields()}")
        checks.one_of("BatchInspector", "sort", self.sort, SORTS)

    def fields(self) -> list[str]:
        keys = set(self.batch.keys())
        out = [name for name in TOKEN_FIELDS if self._column(name) in keys]
        if {"old_log_probs", "ref_log_probs"} <= keys:
            out.append("KL (old - ref)")
        if {"old_log_probs", "rollout_log_probs"} <= keys:
            out.append("mismatch (rollout - trainer)")
        return sorted(out, key=list(TOKEN_FIELDS).index)

    def _scores(self) -> list[float]:
        # Episodes fresh from a multi-turn rollout carry their environment's reward until scored.
        key = next((k for k in ("scores", "episode_reward") if k in self.batch.keys()), None)
        return [float(x) for x in self.batch[key]] if key else [0.0] * len(self.batch)

    def controls(self) -> list[Control]:
        scores = sorted(set(self._scores()))
        return [
            Control(
                "field",
                "colour by",
                "choice",
                self.fields(),
                self.field,
                "the per-token value that shades each response token (red above zero, blue below)",
            ),
            Control("sort", "sort", "choice", SORTS, self.sort, "the order of the rows shown"),
            Control(
                "min_score",
                "min score",
                "choice",
                ["any", *scores],
                "any" if self.min_score is None else self.min_score,
                "show only rows whose score is at least this",
            ),
        ]

    def set(self, **values) -> None:
        if values.get("min_score") == "any":
            values["min_score"] = None
        for name, value in values.items():
            setattr(self, name, value)
        self._check()
        self.changed()

    # ---- what is shown -------------------------------------------------------------------------
    def values(self, field: str | None = None):
        """The per-token column shown (B x T response positions), masked positions as 0."""
        field = field or self.field
        mask = self.batch["response_mask"].float()
        if field == "KL (old - ref)":
            values = self.batch["old_log_probs"] - self.batch["ref_log_probs"]
        elif field == "mismatch (rollout - trainer)":  # the rollout engine's log-prob against the trainer's
            values = self.batch["rollout_log_probs"] - self.batch["old_log_probs"]
        else:
            values = self.batch[self._column(field)]
        return values.float() * mask

    def _column(self, field: str) -> str | None:
        key = TOKEN_FIELDS[field]
        if key == "old_log_probs" and key not in self.batch.keys():  # a fresh rollout: its own log-probs
            return "rollout_log_probs"
        return key

    def _reward_keys(self) -> list[str]:
        return [k for k in self.batch.keys() if k.startswith("reward/") and k != "reward/fallbacks"]

    def rows(self) -> list[dict]:
        """Rows after filtering and sorting: index, prompt, response, score, cost, mean advantage."""
        b, scores = self.batch, self._scores()
        mask = b["response_mask"].float()
        advantage = (
            ((b["advantages"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()
            if "advantages" in b.keys()
            else [0.0] * len(b)
        )
        rows = []
        for i in range(len(b)):
            if self.min_score is not None and scores[i] < self.min_score:
                continue
            prompt = b["prompt"][i] if "prompt" in b.keys() else ""
            response = str(b["response_text"][i]) if "response_text" in b.keys() else ""
            messages = conversation(prompt, response)
            rows.append(
                {
                    "index": i,
                    "prompt": show_conversation(messages[:-1]) if messages else str(prompt),
                    "messages": messages,
                    "response": response,
                    "score": scores[i],
                    "cost": float(b["costs"][i]) if "costs" in b.keys() else None,
                    # several reward functions: each one's value (reward/<name> columns)
                    "rewards": {k.removeprefix("reward/"): float(b[k][i]) for k in self._reward_keys()},
                    "advantage": advantage[i],
                }
            )
        if self.sort.startswith("advantage"):
            rows.sort(key=lambda r: r["advantage"], reverse="high" in self.sort)
        elif self.sort.startswith("score"):
            rows.sort(key=lambda r: r["score"], reverse=True)
        return rows

    def scale(self) -> float:
        values = self.values()
        valid = values[self.batch["response_mask"].bool()]
        return float(valid.abs().max()) if valid.numel() else 0.0

    def tokens(self, index: int) -> list[dict]:
        """Response tokens of one row: text, value of the shown column, colour, and whether it is
        trained on. A multi-turn row also shows its observation tokens (attended, not trained:
        value None, grey)."""
        mask = self.batch["response_mask"][index].bool()
        shown = mask
        if "attention_mask" in self.batch.keys():  # every real token of the response part
            shown = self.batch["attention_mask"][index, -mask.shape[0] :].bool() | mask
        ids = self.batch["responses"][index][shown].tolist()
        trained = mask[shown].tolist()
        values = self.values()[index][shown].tolist()
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode([t]) for t in ids]
        else:
            texts = [str(t) for t in ids]
        scale = self.scale()
        return [
            {"text": t, "value": v if k else None, "colour": shade(v, scale) if k else OBSERVED, "trained": k}
            for t, v, k in zip(texts, values, trained)
        ]

    def marked(self, index: int, marks: tuple[str, str] = ("⟦", "⟧")) -> str:
        """One row's response as text with the mask drawn in: the tokens trained on as they are,
        each run of the others (a multi-turn row's observations and the template around them)
        between `marks`; newlines written as \\n, so a row reads on one line."""
        runs = itertools.groupby(self.tokens(index), key=lambda token: token["trained"])
        parts = []
        for trained, tokens in runs:
            text = "".join(token["text"] for token in tokens).replace("\n", "\\n")
            parts.append(text if trained else f"{marks[0]}{text}{marks[1]}")
        return "".join(parts)

    def data(self) -> dict:
        rows = self.rows()[: self.max_rows]
        return {
            "field": self.field,
            "scale": self.scale(),
            "rows": [{**r, "tokens": self.tokens(r["index"])} for r in rows],
            "matching": len(self.rows()),
            "total": len(self.batch),
        }

    def summary(self) -> str:
        d = self.data()
        head = (
            (f"<b>batch of {escape(self.title)}</b><br>" if self.title else "")
            + f"<div>{d['matching']} of {d['total']} rows; colour: {escape(d['field'])} "
            f"(<span style='background:{shade(d['scale'], d['scale'])}'>&nbsp;+{d['scale']:.3g}&nbsp;</span> "
            f"<span style='background:{shade(-d['scale'], d['scale'])}'>&nbsp;-{d['scale']:.3g}&nbsp;</span>)</div>"
        )
        lines = []
        for r in d["rows"]:
            tokens = "".join(
                f"<span title='{t['value']:.4g}' style='background:{t['colour']}'>{escape(t['text'])}</span>"
                if t["trained"]
                else f"<span title='observation: not trained' style='background:{t['colour']};color:#666'>"
                f"{escape(t['text'])}</span>"
                for t in r["tokens"]
            )
            cost = f" cost {r['cost']:.3g}" if r["cost"] is not None else ""
            cost += "".join(f"<br>{escape(name)} {value:.3g}" for name, value in r["rewards"].items())
            if r["messages"]:  # a chat: its turns, the response coloured as the assistant's
                prompt = "<br>".join(f"<b>{escape(m['role'])}:</b> {escape(m['content'])}" for m in r["messages"][:-1])
                tokens = f"<b>assistant:</b> {tokens}"
            else:
                prompt = escape(r["prompt"])
            lines.append(
                f"<tr><td>{r['index']}</td><td><code>{prompt}</code></td>"
                f"<td><code>{tokens}</code></td><td>{r['score']:.3g}{cost}</td><td>{r['advantage']:+.3f}</td></tr>"
            )
        return (
            head
            + "<table><tr><th>row</th><th>prompt</th><th>response</th><th>score</th><th>mean adv.</th></tr>"
            + "".join(lines)
            + "</table>"
        )


class MetricsTable(View):
    """One iteration's metrics as a table (what a timeline span opens once its batch is gone)."""

    has_figure = False

    def __init__(self, metrics: dict | None, title: str = ""):
        super().__init__()
        self.metrics, self.title = dict(metrics or {}), title

    def set(self, **values) -> None:
        self.changed()

    def data(self) -> dict:
        return {"title": self.title, "metrics": self.metrics}

    def summary(self) -> str:
        head = f"<b>metrics of {escape(self.title)}</b>" if self.title else "<b>metrics</b>"
        if not self.metrics:
            return (
                head + "<div>no metrics or batch held for this span (the batch is kept for the last iterations)</div>"
            )
        rows = "".join(
            f"<tr><td>{escape(k)}</td><td>{v:.4g}</td></tr>" if isinstance(v, (int, float)) else ""
            for k, v in sorted(self.metrics.items())
        )
        return f"{head}<table><tr><th>metric</th><th>value</th></tr>{rows}</table>"
