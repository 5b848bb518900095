"""The training/inference mismatch of one batch, token by token.

The rollout engine samples each token and reports its log-prob (`rollout_log_probs`); the
trainer's forward over the same rows gives its own (`old_log_probs`, with
`old_log_probs="recompute"`). Same weights, different kernels, precisions and batching: the two
disagree a little everywhere and a lot on a few tokens, and a stale or broken weight sync shows
as a disagreement everywhere. `actor/rollout_logprob_diff` is the mean of |rollout - trainer|
over the response tokens; `Mismatch` keeps every token's, for its distribution, the tokens most
off, and what the off-policy corrections' caps (TIS truncates the ratio, "decoupled" drops the
tokens above it) would do to this batch.

    m = mismatch(batch, iteration=3)
    m.mean_abs()           # == metrics["actor/rollout_logprob_diff"]
    m.quantiles()          # {0.5: ..., 0.9: ..., 0.99: ..., 1.0: ...} of |diff|
    m.worst(5, tokenizer)  # the tokens most off: row, position, text, both log-probs, ratio
    m.caps((1.5, 2.0))     # per cap: share of tokens over it, TIS's mean weight, share kept
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from algorithms import core

CAPS = (1.2, 2.0, 5.0)


@dataclass
class Mismatch:
    """One batch's per-token log-probs, rollout against trainer, on its response tokens."""

    iteration: int | None
    rollout: torch.Tensor
    """The rollout engine's log-prob of each response token (flattened, mask applied)."""
    trainer: torch.Tensor
    """The trainer's log-prob of the same tokens."""
    rows: torch.Tensor
    positions: torch.Tensor
    """Where each token is in the batch: its row, and its position among the response tokens."""
    token_ids: torch.Tensor
    batch_rollout: torch.Tensor
    batch_trainer: torch.Tensor
    mask: torch.Tensor
    """The batch's own columns (B x T), for the corrections' caps."""

    @property
    def diff(self) -> torch.Tensor:
        """rollout - trainer, per token."""
        return self.rollout - self.trainer

    @property
    def ratio(self) -> torch.Tensor:
        """pi_trainer / pi_rollout per token: the importance ratio the corrections weigh by."""
        return (self.trainer - self.rollout).clamp(-20, 20).exp()

    def mean_abs(self) -> float:
        """The mean |rollout - trainer| over the response tokens: `actor/rollout_logprob_diff`."""
        return core.rollout_logprob_diff(self.batch_rollout, self.batch_trainer, self.mask)

    def quantiles(self, qs: Iterable[float] = (0.5, 0.9, 0.99, 1.0)) -> dict[float, float]:
        """Quantiles of |rollout - trainer| over the response tokens."""
        gap = self.diff.abs().double()
        if gap.numel() == 0:
            return {q: 0.0 for q in qs}
        return {q: float(torch.quantile(gap, q)) for q in qs}

    def histogram(self, bins: int = 24, low: float = 1e-8) -> tuple[list[float], list[int]]:
        """|rollout - trainer| in log-spaced bins from `low` to the largest (values below `low`,
        exact agreement included, fall in the first): (edges, counts)."""
        gap = self.diff.abs().double().clamp(min=low)
        high = max(float(gap.max()) if gap.numel() else low, low * 10)
        edges = torch.logspace(torch.log10(torch.tensor(low)), torch.log10(torch.tensor(high)) + 1e-9, bins + 1)
        counts = torch.histogram(gap, bins=edges.double()).hist if gap.numel() else torch.zeros(bins)
        return edges.tolist(), [int(c) for c in counts.tolist()]

    def worst(self, k: int = 10, tokenizer=None) -> list[dict]:
        """The k tokens whose log-probs differ most, most first."""
        order = self.diff.abs().argsort(descending=True, stable=True)[:k]
        out = []
        for i in order.tolist():
            token = int(self.token_ids[i])
            out.append(
                {
                    "row": int(self.rows[i]),
                    "position": int(self.positions[i]),
                    "token": token,
                    "text": tokenizer.decode([token]) if tokenizer is not None else str(token),
                    "rollout": float(self.rollout[i]),
                    "trainer": float(self.trainer[i]),
                    "diff": float(self.diff[i]),
                    "ratio": float(self.ratio[i]),
                }
            )
        return out

    def caps(self, caps: Iterable[float] = CAPS) -> list[dict]:
        """What each cap would do to this batch, through the registered corrections themselves:
        the share of response tokens whose ratio is over it, TIS's mean weight (ratios
        truncated at the cap) and the share "decoupled" keeps (tokens over it dropped)."""
        mask, ratio, tokens = self.mask.bool(), self.ratio, max(int(self.mask.sum()), 1)
        tis = core.OFF_POLICY_CORRECTIONS.get("tis")
        decoupled = core.OFF_POLICY_CORRECTIONS.get("decoupled")
        columns = {"old_log_probs": self.batch_trainer, "rollout_log_probs": self.batch_rollout}
        out = []
        for cap in caps:
            weights, _ = tis(response_mask=self.mask, is_cap=cap, **columns)
            kept, _ = decoupled(response_mask=self.mask, is_cap=cap, **columns)
            out.append(
                {
                    "cap": float(cap),
                    "over": float((ratio > cap).sum()) / tokens,
                    "tis_mean_weight": float(weights[mask].mean()) if mask.any() else 1.0,
                    "decoupled_kept": float((kept[mask] > 0).sum()) / tokens,
                }
            )
        return out


def mismatch(batch, iteration: int | None = None) -> Mismatch:
    """The batch's per-token mismatch (it needs `rollout_log_probs` and the trainer's
    `old_log_probs`: the rollout's own under old_log_probs="rollout", then every diff is 0)."""
    missing = [k for k in ("rollout_log_probs", "old_log_probs", "response_mask", "responses") if k not in batch]
    if missing:
        raise ValueError(
            f"mismatch: the batch has no {missing} column(s); it needs the rollout's log-probs (the workbench's "
            "rollouts write them) and the trainer's (old_log_probs; run with old_log_probs='recompute')"
        )
    mask = batch["response_mask"].bool()
    rows, positions = mask.nonzero(as_tuple=True)
    rollout, trainer = batch["rollout_log_probs"], batch["old_log_probs"]
    return Mismatch(
        iteration=iteration,
        rollout=rollout[mask].float(),
        trainer=trainer[mask].float(),
        rows=rows,
        positions=positions,
        token_ids=batch["responses"][mask],
        batch_rollout=rollout,
        batch_trainer=trainer,
        mask=batch["response_mask"],
    )
