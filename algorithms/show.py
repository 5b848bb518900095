"""A compact text view of an iteration's batch, for notebook cells and logs."""

from __future__ import annotations

from algorithms.core import masked_mean


def rollout_table(batch, rows: int = 6, width: int = 16) -> str:
    """prompt | response | score | advantage (mean over the response) | response length,
    one line per row, for whichever of these columns the batch has so far. A chat prompt shows
    its last turn (the question; `widgets.BatchInspector` shows every turn)."""
    mask = batch["response_mask"].float()
    columns = {"prompt": lambda i: repr(_question(batch["prompt"][i]))[:width]}
    if "response_text" in batch:
        columns["response"] = lambda i: repr(str(batch["response_text"][i]))[:width]
    if "scores" in batch:
        columns["score"] = lambda i: f"{float(batch['scores'][i]):.3g}"
    if "advantages" in batch:
        advantages = masked_mean(batch["advantages"], mask, -1)
        columns["adv"] = lambda i: f"{float(advantages[i]):+.3f}"
    columns["len"] = lambda i: str(int(mask[i].sum()))
    cells = [[name] + [fn(i) for i in range(min(rows, len(batch)))] for name, fn in columns.items()]
    widths = [max(len(c) for c in column) for column in cells]
    lines = ["  ".join(column[r].ljust(w) for column, w in zip(cells, widths)).rstrip() for r in range(len(cells[0]))]
    more = f"\n... {len(batch) - rows} more rows" if len(batch) > rows else ""
    return "\n".join(lines) + more


def _question(prompt) -> str:
    return str(prompt[-1]["content"]) if isinstance(prompt, list) and prompt else str(prompt)
