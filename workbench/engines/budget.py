"""Token-budget micro-batches: a step's rows cut by tokens, not by a row count.

With `micro_batch_size` rows per forward, 8 answers of 3 tokens cost a micro-batch as 8 of 256
do: memory is sized for the worst, and the short ones waste it. With `max_tokens_per_micro_batch`
every micro-batch is filled up to that many tokens — a row's cost is its real tokens, a prompt
that several rows of the micro-batch share counted once (what a packed forward computes,
workbench.engines.packing) — so a micro-batch holds many short rows or a few long ones.

- Every rank of a data-parallel group runs the same number of micro-batches (FSDP and ZeRO-3
  gather weights per forward, so a rank with one micro-batch more would wait forever): each rank
  finds the fewest it needs, the group takes the largest, and each rank spreads its rows over
  that many, the largest first into the lightest (`split`).
- Ranks get equal token loads, not only equal row counts (`balance`, on the driver before the
  rows are sent): within each global mini-batch its rows are dealt to the ranks round by round,
  the largest of a round to the lightest rank, which keeps every rank within one row's tokens
  of every other. A prompt's rows stay on one rank where that is as balanced.
- A row longer than the budget is refused by name before any work (`check_rows`): a budget is
  a memory bound, and a row that breaks it would run out of memory on a device or hide a
  misconfigured budget.

Gradients are the row-count path's within float rounding: each micro-batch weighs its share of
the step (workbench.engines.accumulation), whatever its size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from workbench.data.batch import Batch
from workbench.engines.packing import prompt_groups
from workbench.errors import ConfigError


def row_tokens(batch: Batch) -> torch.Tensor:
    """Real tokens of each row (prompt and response): B."""
    return batch["attention_mask"].sum(1)


def check_rows(batch: Batch, budget: int, owner: str) -> None:
    """Refuse a batch with a row longer than `budget` tokens, naming the field to raise."""
    tokens = row_tokens(batch)
    longest = int(tokens.max()) if len(tokens) else 0
    if longest > budget:
        row = int(tokens.argmax())
        raise ConfigError(
            f"{owner}.max_tokens_per_micro_batch",
            budget,
            f"row {row} has {longest} tokens (prompt and response), more than one micro-batch may hold; "
            f"raise it to at least the longest prompt plus max_new_tokens ({longest} here)",
        )


def _units(batch: Batch) -> list[tuple[int, list[int]]]:
    """(tokens, rows) per prompt group: rows alike in prompt ids and mask, the prompt counted once."""
    tokens = row_tokens(batch).tolist()
    prompt = batch["attention_mask"][:, : batch["input_ids"].shape[1] - batch["responses"].shape[1]].sum(1).tolist()
    members: dict[int, list[int]] = {}
    for row, g in enumerate(prompt_groups(batch)[1].tolist()):
        members.setdefault(g, []).append(row)
    return [(sum(tokens[r] for r in rows) - prompt[rows[0]] * (len(rows) - 1), rows) for rows in members.values()]


def _fill(units: list[tuple[int, list[int]]], bins: int) -> list[tuple[int, list[int]]]:
    """Largest first into the lightest of `bins` bins: (tokens, rows) per bin."""
    loads = [(0, [])] * bins
    for tokens, rows in sorted(units, key=lambda u: -u[0]):
        lightest = min(range(bins), key=lambda b: loads[b][0])
        loads[lightest] = (loads[lightest][0] + tokens, loads[lightest][1] + rows)
    return loads


def _plan(batch: Batch, budget: int, bins: int) -> list[list[int]] | None:
    """Rows of `bins` micro-batches of at most `budget` tokens each, none empty, or None when
    these rows do not go into that many."""
    units = _units(batch)
    tokens = row_tokens(batch).tolist()
    # A prompt group over the budget, or too few groups for the bins: its rows go alone.
    while True:
        big = [u for u in units if u[0] > budget and len(u[1]) > 1]
        if not big and len(units) >= bins:
            break
        if not big:
            splittable = [u for u in units if len(u[1]) > 1]
            if not splittable:
                return None
            big = [max(splittable, key=lambda u: u[0])]
        units.remove(big[0])
        units += [(tokens[r], [r]) for r in big[0][1]]
    filled = _fill(units, bins)
    if any(load > budget or not rows for load, rows in filled):
        return None
    return [sorted(rows) for _, rows in filled]


def split(batch: Batch, budget: int, group=None) -> list[torch.Tensor]:
    """The rows (indices into `batch`, this rank's rows of one optimizer step) of micro-batches
    of at most `budget` tokens each, as many on every rank of `group` (the data-parallel
    group): see the module docstring. Rows keep their order inside a micro-batch."""
    if len(batch) == 0:
        return []
    plan = None
    least = -(-sum(tokens for tokens, _ in _units(batch)) // budget)  # a shared prompt counted once
    for bins in range(max(1, least), len(batch) + 1):
        plan = _plan(batch, budget, bins)
        if plan is not None:
            break
    if plan is None:  # a row alone is over the budget
        check_rows(batch, budget, "the worker's config")
        raise AssertionError("no micro-batch plan, yet every row fits the budget")
    wanted = len(plan)
    if group is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        from workbench.engines.accumulation import all_reduce_small

        wanted = int(all_reduce_small(torch.tensor([wanted]), group, op=dist.ReduceOp.MAX).item())
    if wanted > len(batch):
        raise RuntimeError(
            f"another data-parallel rank needs {wanted} micro-batches and this one has {len(batch)} rows: "
            "ranks must get equal row counts"
        )
    if wanted > len(plan):
        plan = _plan(batch, budget, wanted) or _halved(plan, wanted)
    return [torch.tensor(rows) for rows in plan]


def cut(batch: Batch, rows: int, budget: int | None, group=None) -> tuple[list[torch.Tensor] | None, list[Batch]]:
    """`batch` cut for forwards: by `budget` tokens (`split`) when one is set, else `rows` rows
    at a time. (the plan, for `in_order`: None when cut by rows; the micro-batches)"""
    if budget is None:
        return None, [batch[i : i + rows] for i in range(0, len(batch), rows)]
    plan = split(batch, budget, group)
    return plan, [batch[index] for index in plan]


def micro_batches(batch: Batch, rows: int, budget: int | None, group=None) -> list[Batch]:
    """`cut`'s micro-batches: a step's, whose outputs need no order."""
    return cut(batch, rows, budget, group)[1]


def in_order(parts: list[torch.Tensor], plan: list[torch.Tensor] | None) -> torch.Tensor:
    """Per-micro-batch outputs (rows first) back in the batch's row order: `plan` is `split`'s
    (None: the micro-batches were consecutive rows)."""
    joined = torch.cat(parts)
    if plan is None:
        return joined
    out = torch.empty_like(joined)
    out[torch.cat(plan)] = joined
    return out


def _halved(plan: list[list[int]], bins: int) -> list[list[int]]:
    """`plan` with its largest micro-batches halved until there are `bins` (halves never hold
    more tokens than the whole)."""
    plan = list(plan)
    while len(plan) < bins:
        rows = plan.pop(max(range(len(plan)), key=lambda b: len(plan[b])))
        plan += [rows[: len(rows) // 2], rows[len(rows) // 2 :]]
    return plan


def for_update(batch: Batch, group, owner: str) -> Batch:
    """On the driver, before an update's rows are sent to `group` (its config and mesh): under
    a token budget, a row over it refused by name and the rows dealt to balance the ranks'
    tokens (`balance`); unchanged otherwise. A critic that reuses compute_values' forward keeps
    its rows where they were (the kept forward is of those rows)."""
    config = group.config
    limit = getattr(config, "max_tokens_per_micro_batch", None)
    if limit is None:
        return batch
    check_rows(batch, limit, owner)
    if getattr(config, "reuse_values_forward", False):
        return batch
    return balance(batch, group.mesh.dp, config.mini_batch_size)


def balance(batch: Batch, dp: int, mini_batch_size: int) -> Batch:
    """`batch` reordered so that the contiguous equal parts the dp ranks get carry equal token
    loads within one row's tokens, inside every global mini-batch (the rows of each optimizer
    step stay the same: only which rank computes which of them changes). The ranks' steps take
    rows_per_step = mini_batch_size // dp rows of their part at a time."""
    if dp <= 1 or len(batch) % dp:
        return batch
    part = len(batch) // dp
    step = max(1, min(mini_batch_size // dp, part))
    tokens = row_tokens(batch).tolist()
    order = [0] * len(batch)
    for start in range(0, part, step):
        count = min(step, part - start)
        # the rows of this global mini-batch: `count` from every rank's part
        rows = [k * part + start + j for k in range(dp) for j in range(count)]
        ranks = _deal(batch[torch.tensor(rows)], [tokens[r] for r in rows], dp)
        for k, members in enumerate(ranks):
            for j, local in enumerate(members):
                order[k * part + start + j] = rows[local]
    return batch[torch.tensor(order)]


def _deal(rows: Batch, tokens: list[int], dp: int) -> list[list[int]]:
    """Equal shares of `rows` (indices into it) for dp ranks, loads within one row of each
    other: whole prompt groups when their deal is that balanced, else row by row."""
    units = _units(rows)
    if len({len(u[1]) for u in units}) == 1 and len(units) % dp == 0:
        grouped = _rounds([(t, members) for t, members in units], dp)
        loads = [sum(tokens[r] for r in members) for members in grouped]
        if max(loads) - min(loads) <= max(tokens):
            return grouped
    return _rounds([(t, [r]) for r, t in enumerate(tokens)], dp)


def _rounds(units: list[tuple[int, list[int]]], dp: int) -> list[list[int]]:
    """Equal numbers of units per rank: units taken largest first, dp at a time, the largest of
    each round to the lightest rank. Every round moves any two ranks' difference by at most the
    round's largest minus its smallest unit, and never past the larger of that and the old
    difference, so loads end within one unit of each other."""
    ranks: list[tuple[int, list[int]]] = [(0, []) for _ in range(dp)]
    ordered = sorted(units, key=lambda u: -u[0])
    for first in range(0, len(ordered), dp):
        by_load = sorted(range(dp), key=lambda k: ranks[k][0])
        for k, (t, members) in zip(by_load, ordered[first : first + dp]):
            ranks[k] = (ranks[k][0] + t, ranks[k][1] + members)
    return [sorted(members) for _, members in ranks]
