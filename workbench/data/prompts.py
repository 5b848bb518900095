"""Prompt datasets: rows of `prompt` / `ground_truth` from a file or a Hugging Face dataset
(`workbench.data.sources`), and the loader that turns them into Batches of left-padded token ids.

A prompt is text, or a chat: a list of messages `{"role": "system"|"user"|..., "content": str}`,
rendered with the tokenizer's chat template and the opening of the assistant's reply
(`add_generation_prompt=True`), so the model answers in its own turn (`render_prompt` shows the
text it sees). Plain text goes through the tokenizer as it is (the tiny kit's `Q: 1+8=? A:`).

A row's other columns (verl's `data_source`, `extra_info`, `reward_model`; reasoning-gym's
`metadata`; a `uid`) are kept as they are, nested values included. They become columns of the
Batch a loader yields, beside its tensors `input_ids`, `attention_mask`, `position_ids`
(B x T, left-padded, so every prompt ends at the last column where generation continues) and
the columns `prompt`, `ground_truth`, `uid`; they follow every row through the iteration, so
reward functions can read them, and `rollouts.jsonl` writes them with each response.

Prompts longer than `max_prompt_length` tokens are refused (default) or truncated on the
left (keeping the end of the prompt, where the question is), never cut silently:
the count of truncated rows is in `Batch.info["num_truncated"]`.
"""

from __future__ import annotations

import itertools
import json
import os
import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from workbench import checks, steps
from workbench.data.arithmetic import ArithmeticConfig, generate
from workbench.data.batch import PAD_KEY, Batch
from workbench.data.sources import PromptDataError, map_columns, read_rows, same_keys


# ---- reading and writing ---------------------------------------------------------------------
def load_prompts(
    path: str | os.PathLike,
    columns: Mapping[str, str] | None = None,
    *,
    split: str | None = None,
    prompt_key: str | None = None,
    ground_truth_key: str | None = None,
) -> list[dict[str, Any]]:
    """Rows of a prompt source (see `workbench.data.sources`) as dicts with `prompt`,
    `ground_truth` (text) and the source's other columns, the same keys in every row.

    `columns` maps `prompt` / `ground_truth` to the source's own columns, dotted into nested
    ones: `{"prompt": "question", "ground_truth": "answer"}` for a GSM8K-style file. With none,
    a row without `ground_truth` takes verl's `reward_model.ground_truth`. `prompt_key` /
    `ground_truth_key` are shorthands for the two entries. `split` picks a dataset's split
    (default "train").
    """
    mapping = dict(columns or {})
    for name, key in (("prompt", prompt_key), ("ground_truth", ground_truth_key)):
        if key is not None:
            if mapping.get(name, key) != key:
                raise PromptDataError(
                    f"load_prompts: {name} is mapped twice, to {mapping[name]!r} (columns) and {key!r} "
                    f"({name}_key); give one"
                )
            mapping[name] = key
    path = Path(path)
    where = repr(str(path))
    rows = read_rows(path, split)
    if not rows:
        raise PromptDataError(f"prompt file {where} has no rows")
    rows = map_columns(rows, mapping, where)
    for i, row in enumerate(rows):
        check_prompt(row["prompt"], f"{where} row {i}: {mapping.get('prompt', 'prompt')!r}")
    return rows


def split_held_out(rows: list[dict[str, Any]], fraction: float, seed: int = 0) -> tuple[list, list]:
    """(training rows, held-out rows): a seeded `fraction` of the rows held out, each side in
    the rows' own order. Training rows asking a held-out prompt are dropped, so the evaluation
    never scores a prompt the policy trained on."""
    if not 0 < fraction < 1:
        raise PromptDataError(
            f"data.eval_fraction={fraction} must lie strictly between 0 and 1 (e.g. 0.1 holds out a "
            "tenth of the prompts)"
        )
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    chosen = set(order[: round(fraction * len(rows))])
    held_out = [row for i, row in enumerate(rows) if i in chosen]
    asked = {prompt_identity(row["prompt"]) for row in held_out}
    train = [row for i, row in enumerate(rows) if i not in chosen and prompt_identity(row["prompt"]) not in asked]
    if not held_out or not train:
        empty = "held-out" if not held_out else "training"
        raise PromptDataError(
            f"data.eval_fraction={fraction} of {len(rows)} rows leaves the {empty} side empty "
            f"({len(train)} training, {len(held_out)} held out, after dropping training rows that repeat a "
            "held-out prompt). Choose a fraction nearer 0.5, give more rows, or give data.eval_file"
        )
    return train, held_out


def prompt_identity(prompt: Any) -> str:
    """A hashable stand-in for a prompt (a chat is a list of dicts): equal prompts, equal strings."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def write_jsonl(rows: Iterable[dict[str, Any]], path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def write_arithmetic(
    path: str | os.PathLike, cfg: ArithmeticConfig = ArithmeticConfig(), n: int = 1000, seed: int = 0
) -> Path:
    """Write n arithmetic problems as a prompt JSONL (columns prompt, ground_truth, data_source)."""
    rows = (
        {"prompt": p.prompt, "ground_truth": p.ground_truth, "data_source": "arithmetic"}
        for p in generate(cfg, n, seed)
    )
    return write_jsonl(rows, path)


# ---- chat prompts ------------------------------------------------------------------------------
ROLES = ("system", "user", "assistant", "tool")


def check_prompt(prompt: Any, where: str) -> None:
    """Refuse a prompt that is neither text nor a list of {"role", "content"} messages."""
    if isinstance(prompt, str):
        return
    example = '[{"role": "user", "content": "What is 2+3?"}]'
    if not isinstance(prompt, list) or not prompt:
        kind = type(prompt).__name__ if not isinstance(prompt, list) else "an empty list"
        raise PromptDataError(f"{where} must be text or a list of chat messages like {example}, got {kind}")
    for j, message in enumerate(prompt):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise PromptDataError(
                f"{where}, message {j}: {message!r} is not a chat message; each needs a text 'role' "
                f"(one of {list(ROLES)}) and a text 'content', like {example}"
            )


def render_prompt(prompt: str | list[dict[str, str]], tokenizer) -> str:
    """The text the model sees: a chat rendered with the tokenizer's template and the opening
    of the assistant's turn; plain text as it is."""
    if isinstance(prompt, str):
        return prompt
    _check_template(tokenizer)
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)


def conversation(prompt: str | list[dict[str, str]], response: str) -> list[dict[str, str]] | None:
    """A chat prompt with the response as the assistant's turn (what logs and the batch
    inspector show); None for a text prompt, which has no turns."""
    if isinstance(prompt, str):
        return None
    return [*({"role": m["role"], "content": m["content"]} for m in prompt), {"role": "assistant", "content": response}]


def show_conversation(messages: list[dict[str, str]]) -> str:
    """Messages as `role: content` lines, e.g. `user: What is 2 + 3?`."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


def prompt_ids(prompt: str | list[dict[str, str]], tokenizer) -> list[int]:
    """Token ids of one prompt: text through the tokenizer (its special tokens, e.g. <s>,
    added), a chat through its template (which writes every special token itself)."""
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    _check_template(tokenizer)
    return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False))


def _check_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise PromptDataError(
            "chat prompts need a tokenizer with a chat template, and this one has none. Use a chat "
            "model's tokenizer (e.g. one imported with workbench.models.import_gguf), set "
            "tokenizer.chat_template, or give the prompts as text"
        )


# ---- tokenizing into Batches -------------------------------------------------------------------
TENSORS = ("input_ids", "attention_mask", "position_ids")
"""The tensors of a prompt Batch."""


@dataclass
class PromptLoaderConfig:
    """How prompts become Batches."""

    batch_size: int = 8
    """Prompts per Batch."""
    max_prompt_length: int = 128
    """Most tokens per prompt (special tokens included)."""
    overlong: Literal["refuse", "truncate"] = "refuse"
    """A longer prompt: "refuse" raises naming the row, "truncate" keeps its last tokens."""
    pad_to_max_length: bool = False
    """Pad every Batch to max_prompt_length columns (static shapes) instead of its longest row."""
    shuffle: bool = True
    """Visit rows in a new order each epoch (seeded by seed + epoch)."""
    seed: int = 0
    drop_last: bool = False
    """Skip a final Batch smaller than batch_size."""


def tokenize_prompts(
    rows: list[dict[str, Any]],
    tokenizer,
    max_prompt_length: int,
    overlong: Literal["refuse", "truncate"] = "refuse",
    pad_to_max_length: bool = False,
    indices: list[int] | None = None,
) -> Batch:
    """One Batch of left-padded prompts (text or chat messages: see `prompt_ids`).

    position_ids count real tokens only (0 at the first non-pad token), the convention
    HF and vLLM use for left-padded generation. `indices` are the rows' places in their
    dataset, used in errors and as the default uid.
    """
    checks.one_of("tokenize_prompts", "overlong", overlong, ("refuse", "truncate"))
    if tokenizer.pad_token_id is None:
        raise PromptDataError(
            "the tokenizer has no pad token; load it with workbench.models.load_tokenizer "
            "(LoadConfig(pad_token='eos')) or set tokenizer.pad_token"
        )
    indices = list(range(len(rows))) if indices is None else indices
    encoded, truncated = [], 0
    for index, row in zip(indices, rows):
        check_prompt(row["prompt"], f"prompt row {index}")
        ids = prompt_ids(row["prompt"], tokenizer)
        if len(ids) > max_prompt_length:
            if overlong == "refuse":
                raise PromptDataError(
                    f"prompt row {index} is {len(ids)} tokens, over max_prompt_length={max_prompt_length} "
                    f"(starts {render_prompt(row['prompt'], tokenizer)[:40]!r}). Raise max_prompt_length, or set "
                    f"overlong='truncate' to keep its last {max_prompt_length} tokens"
                )
            ids, truncated = ids[-max_prompt_length:], truncated + 1
        encoded.append(ids)

    width = max_prompt_length if pad_to_max_length else max((len(ids) for ids in encoded), default=0)
    input_ids, attention_mask = left_padded(encoded, tokenizer.pad_token_id, width=width)
    position_ids = torch.clamp(attention_mask.cumsum(dim=1) - 1, min=0)

    columns = {
        "prompt": [r["prompt"] for r in rows],
        "ground_truth": [r["ground_truth"] for r in rows],
        "uid": [str(i if r.get("uid") is None else r["uid"]) for i, r in zip(indices, rows)],
    }
    for key in dict.fromkeys(k for r in rows for k in r):  # the rows' other columns, first-seen order
        if key not in columns:
            _check_column_name(key)
            columns[key] = [r.get(key) for r in rows]
    return Batch(
        dict(zip(TENSORS, (input_ids, attention_mask, position_ids))),
        columns,
        {"max_prompt_length": max_prompt_length, "num_truncated": truncated},
    )


def _check_column_name(key: str) -> None:
    """Refuse a row column named like a field the Batch or a step of the iteration makes: the
    column would shadow it (a Batch reads columns first)."""
    made_by = "tokenize_prompts" if key in (*TENSORS, PAD_KEY) else steps.producer_of(key)
    if made_by:
        raise PromptDataError(
            f"prompt column {key!r} has the name of a field {made_by!r} adds to the batch; rename the column "
            "in the source (or drop it from the rows)"
        )


def left_padded(
    rows: list[list[int]], pad: int, device=None, *, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as left-padded input_ids and attention_mask (a prompt batch's layout), `width`
    columns (default: the longest row, at least 1), on `device` (the worker's: a GPU actor's
    contexts go where its model is)."""
    width = max(1, max((len(r) for r in rows), default=0)) if width is None else width
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return ids.to(device), mask.to(device)


class PromptLoader:
    """Iterate a prompt dataset as Batches; one `for` loop is one epoch.

    >>> loader = PromptLoader(load_prompts("train.jsonl"), tokenizer, PromptLoaderConfig(batch_size=16))
    >>> for batch in loader: ...
    """

    def __init__(self, rows: list[dict[str, Any]], tokenizer, cfg: PromptLoaderConfig | None = None):
        cfg = cfg or PromptLoaderConfig()
        checks.whole(
            "PromptLoaderConfig", "batch_size", cfg.batch_size, fix="use a whole number of prompts >= 1 per Batch"
        )
        self.rows, self.tokenizer, self.cfg = same_keys(rows), tokenizer, cfg
        self.epoch = 0
        if cfg.overlong == "refuse":
            self.check_lengths()

    def check_lengths(self) -> None:
        """Refuse an overlong prompt now, before any epoch starts, rather than mid-run."""
        limit = self.cfg.max_prompt_length
        texts = [r["prompt"] for r in self.rows if isinstance(r["prompt"], str)]
        encoded = iter(self.tokenizer(texts)["input_ids"] if texts else [])  # text rows in one call
        lengths = [
            len(next(encoded) if isinstance(r["prompt"], str) else prompt_ids(r["prompt"], self.tokenizer))
            for r in self.rows
        ]
        for index, length in enumerate(lengths):
            if length > limit:
                raise PromptDataError(
                    f"prompt row {index} is {length} tokens, over max_prompt_length={limit} "
                    f"(starts {render_prompt(self.rows[index]['prompt'], self.tokenizer)[:40]!r}; "
                    f"{sum(n > limit for n in lengths)} "
                    f"rows are too long). Raise max_prompt_length, or set overlong='truncate' "
                    f"to keep their last {limit} tokens"
                )

    def mean_width(self, most_batches: int = 32) -> float:
        """Mean columns of this loader's Batches (its first epoch, up to `most_batches` of them):
        the padded prompt length the workers compute on, which a planner should price rather
        than max_prompt_length (prompts are padded to the longest in their Batch)."""
        if self.cfg.pad_to_max_length:
            return float(self.cfg.max_prompt_length)
        widths = [self._batch(0, i)["input_ids"].shape[1] for i in range(min(len(self), most_batches))]
        return sum(widths) / len(widths) if widths else float(self.cfg.max_prompt_length)

    def __len__(self) -> int:
        full, rest = divmod(len(self.rows), self.cfg.batch_size)
        return full + (1 if rest and not self.cfg.drop_last else 0)

    def __iter__(self) -> Iterator[Batch]:
        """One epoch (the next: each `for` loop reshuffles)."""
        epoch = self.epoch
        self.epoch += 1
        for index in range(len(self)):
            yield self._batch(epoch, index)

    def batches(self, start: int = 0) -> Iterator[Batch]:
        """Batches without end, from global batch number `start` (epoch after epoch, each
        shuffled by seed + epoch): the loader's position in a run is just the number of batches
        consumed, so a resumed run passes that and sees what the uninterrupted run saw."""
        per_epoch = len(self)
        if per_epoch == 0:
            raise PromptDataError("PromptLoader.batches: no rows (or drop_last leaves no full batch)")
        for number in itertools.count(start):
            yield self._batch(*divmod(number, per_epoch))

    def _batch(self, epoch: int, index: int) -> Batch:
        order = list(range(len(self.rows)))
        if self.cfg.shuffle:
            random.Random(self.cfg.seed + epoch).shuffle(order)
        chosen = order[index * self.cfg.batch_size : (index + 1) * self.cfg.batch_size]
        batch = tokenize_prompts(
            [self.rows[i] for i in chosen],
            self.tokenizer,
            self.cfg.max_prompt_length,
            self.cfg.overlong,
            self.cfg.pad_to_max_length,
            indices=chosen,
        )
        batch.info["epoch"] = epoch
        return batch
