"""A multi-turn rollout's turns on the HF engine, each continuing from the last turn's KV cache.

An episode's context at its next turn is its context now, the tokens it just sampled, and the
environment's observation. Generating every turn afresh over the left-padded contexts computes
the prompt and every earlier turn again (on the tool task the second turn's prefill cost more
than its decoding). `HFTurns` keeps the layout and the KV cache `generate` ended with, drops the
rows whose episode ended, and appends only what is new:

    columns:  [pad | prompt | turn 1, holes after its end | pad | observation | turn 2 ... ]

Holes (attention 0) are the padding after a turn that stopped early and before a shorter row's
new tokens; positions count real tokens only, so every real token sits where a training forward
over the contiguous trajectory puts it, and the log-probs are that forward's (within float
rounding). A turn whose rows do not extend what is cached (another batch, a changed context)
starts afresh. vLLM needs none of this: its prefix cache finds the shared prefix by itself.
"""

from __future__ import annotations

import torch

from workbench.data.batch import Batch
from workbench.data.prompts import left_padded
from workbench.engines.rollout import SamplingConfig


class HFTurns:
    """Generations for the turns of one batch of episodes on an HFRollout (`rollout.turns()`)."""

    def __init__(self, rollout):
        self.rollout = rollout
        self._rows: dict = {}  # episode key -> its row in the cached layout
        self._real: list[list[int]] = []  # each cached row's real tokens, in order
        self._ids: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._cache = None
        self.continued = 0
        """Turns that continued from the cache (the rest started afresh)."""

    @torch.no_grad()
    def generate(self, keys: list, contexts: list[list[int]], sampling: SamplingConfig) -> Batch:
        """One turn: a response to each context (`responses`, `response_mask`,
        `rollout_log_probs`, rows in `keys` order). `keys` name the episodes, so the next turn
        finds each one's cached row."""
        if sampling.n != 1:
            raise ValueError(f"HFTurns generates one response per episode, not SamplingConfig.n={sampling.n}")
        pad = self.rollout.pad_token_id
        rows = self._cached_rows(keys, contexts)
        if rows is None:
            (ids, mask), cache = left_padded(contexts, pad, self.rollout.model.device), None
        else:
            assert self._ids is not None and self._mask is not None
            index = torch.tensor(rows)
            new = [context[len(self._real[row]) :] for row, context in zip(rows, contexts)]
            new_ids, new_mask = left_padded(new, pad, self._ids.device)
            ids = torch.cat([self._ids[index], new_ids], dim=1)
            mask = torch.cat([self._mask[index], new_mask], dim=1)
            cache = self._cache
            cache.batch_select_indices(index)  # the rows whose episodes go on
            self.continued += 1
        decoded = self.rollout.decode(ids, mask, sampling, past_key_values=cache)
        steps = decoded.steps
        self._ids = torch.cat([ids, decoded.responses[:, :steps]], dim=1)
        self._mask = torch.cat([mask, decoded.response_mask[:, :steps].to(mask.dtype)], dim=1)
        self._cache = decoded.cache
        self._rows = {key: row for row, key in enumerate(keys)}
        kept = decoded.response_mask.sum(1).tolist()
        self._real = [
            context + decoded.responses[row, :n].tolist() for row, (context, n) in enumerate(zip(contexts, kept))
        ]
        return Batch(
            {
                "responses": decoded.responses,
                "response_mask": decoded.response_mask,
                "rollout_log_probs": decoded.log_probs * decoded.response_mask,
            }
        )

    def _cached_rows(self, keys: list, contexts: list[list[int]]) -> list[int] | None:
        """Each episode's cached row, when every context extends its cached tokens; else None."""
        if self._cache is None or any(key not in self._rows for key in keys):
            return None
        rows = [self._rows[key] for key in keys]
        for row, context in zip(rows, contexts):
            real = self._real[row]
            if len(context) <= len(real) or context[: len(real)] != real:
                return None
        return rows
