"""What a run writes as it goes: metrics (JSONL, TensorBoard, W&B) and rollout logs.

metrics.jsonl   one JSON object per iteration (and per evaluation), `iteration` first
tensorboard/    event files, one scalar per metric, stepped by iteration
rollouts.jsonl  every k iterations, one object per response row: prompt, response, ground
                truth, score (cost), the response's tokens with their advantages (and returns).
                A chat prompt's row also has `messages`, the conversation with the response as
                the assistant's turn, and its `prompt` is the text the model saw (the template's
                markers kept); `response` is the assistant's text, as the reward read it. With
                several reward functions, each one's value (`reward/<name>`); and the prompt
                rows' own columns (`data_source`, `extra_info`, ...).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from workbench.data.batch import Batch
from workbench.data.prompts import conversation, render_prompt


class MetricLog:
    """Appends each iteration's metrics to metrics.jsonl, TensorBoard and (when asked) W&B."""

    def __init__(
        self,
        directory: Path,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        run_name: str = "run",
        config: dict | None = None,
    ):
        self.path = directory / "metrics.jsonl"
        self.file = self.path.open("a", encoding="utf-8")
        self.tensorboard_dir = directory / "tensorboard" if tensorboard else None
        self.writer = None
        if self.tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter  # the tensorboard package, on first use

            self.writer = SummaryWriter(str(self.tensorboard_dir))
        self.wandb = None
        if wandb_project:
            import wandb

            self.wandb = wandb.init(project=wandb_project, name=run_name, config=config, dir=str(directory))

    def write(self, iteration: int, metrics: dict[str, Any]) -> None:
        row = {"iteration": iteration, **{k: v for k, v in metrics.items() if k != "iteration"}}
        self.file.write(json.dumps(row, default=_number) + "\n")
        self.file.flush()  # a run read while it goes (or after a crash) has every finished iteration
        scalars = {k: float(v) for k, v in row.items() if k != "iteration" and isinstance(v, (int, float))}
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, iteration)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=iteration)

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def last_logged_iteration(path: Path) -> int:
    """The highest iteration in an existing metrics.jsonl (0 when there is none)."""
    if not path.exists():
        return 0
    highest = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            highest = max(highest, int(json.loads(line).get("iteration", 0)))
        except (ValueError, AttributeError):
            continue  # a line cut short by a crash
    return highest


def rollout_rows(batch: Batch, tokenizer, iteration: int, limit: int = 0) -> list[dict[str, Any]]:
    """The rows of a finished iteration's batch as plain dicts: what was asked, answered, scored,
    and how each response token was credited (its advantage). The prompt rows' other columns
    (`data_source`, `extra_info`, ...) follow under their own names, JSON-safe (a value json
    cannot write becomes text); a column named like a key written here is left out."""
    written = ("iteration", "row", "uid", "prompt", "messages", "response", "ground_truth", "score", "cost")
    written += ("tokens", "advantages", "returns", "cost_advantages", "token_level_rewards")
    written += ("response_text",)  # the actor's decoding of the response: `response` already
    extra = [key for key in batch.columns if key not in written]
    rows = []
    count = len(batch) if not limit else min(limit, len(batch))
    mask = batch["response_mask"].bool()
    prompt_ids, prompt_mask = _prompt_part(batch)
    for i in range(count):
        ids = batch["responses"][i][mask[i]].tolist()
        prompt = batch["prompt"][i] if "prompt" in batch else None
        response = tokenizer.decode(ids, skip_special_tokens=True)
        chat = prompt is not None and not isinstance(prompt, str)
        row = {
            "iteration": iteration,
            "row": i,
            "uid": _column(batch, "uid", i),
            "prompt": (
                render_prompt(prompt, tokenizer)
                if chat
                else tokenizer.decode(prompt_ids[i][prompt_mask[i]].tolist(), skip_special_tokens=True)
            ),
            **({"messages": conversation(prompt, response)} if chat else {}),
            "response": response,
            "ground_truth": _column(batch, "ground_truth", i),
        }
        for key in ("scores", "costs"):
            if key in batch:
                row[key[:-1]] = _round(batch[key][i])
        # several reward functions: each one's value (reward/<name>), and how many fell back
        row.update((k, _round(batch[k][i])) for k in batch.tensors.keys() if k.startswith(("reward/", "cost/")))
        row.update((key, json.loads(json.dumps(batch.columns[key][i], default=str))) for key in extra)
        row["tokens"] = [tokenizer.decode([token]) for token in ids]  # readable pieces, one per advantage
        for key in ("advantages", "returns", "cost_advantages", "token_level_rewards"):
            if key in batch:
                row[key] = [_round(v) for v in batch[key][i][mask[i]]]
        rows.append(row)
    return rows


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, default=_number) + "\n")


def _prompt_part(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt token ids and mask: input_ids minus the response columns at the end."""
    width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    return batch["input_ids"][:, :width], batch["attention_mask"][:, :width].bool()


def _column(batch: Batch, key: str, i: int):
    return str(batch[key][i]) if key in batch else None


def _round(value) -> float:
    value = float(value)
    return round(value, 6) if math.isfinite(value) else value


def _number(value):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return str(value)
