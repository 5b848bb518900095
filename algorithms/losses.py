"""The loss functions shipped to the workers: core's numerics around one model forward.

Each is a small dataclass called as `loss(outputs, micro_batch) -> (loss, metrics)` on every rank
(workbench.engines.contract.LossFn): the worker's engine runs the forward its `needs` names and
hands the loss the outputs, never the model. The driver builds a fresh one per update from the current settings
and registry entries, and Ray pickles it with them — a policy loss redefined in a notebook
cell travels by value, so workers always run what the notebook last defined.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

from algorithms import core


@dataclass
class ActorLoss:
    """policy loss + kl_coef * KL(pi || pi_ref) (KL in the loss, GRPO style) - entropy_coeff * H."""

    policy: Callable
    """A policy loss (core.POLICY_LOSSES entry): (loss, metrics) from log_probs, the batch, settings."""
    settings: dict = field(default_factory=dict)
    """Values for the policy loss's keyword parameters (clip ranges, loss_agg_mode, ...)."""
    temperature: float = 1.0
    """The sampling temperature: the worker computes log-probs as log_softmax(logits / T), as the
    rollout's were."""
    entropy_coeff: float = 0.0
    kl_coef: float = 0.0
    """> 0 adds the KL to the reference policy to the loss (needs ref_log_probs in the batch)."""
    kl_penalty: Callable = core.kl_k3
    loss_agg_mode: str = "token-mean"
    correction: Callable | None = None
    """An off-policy correction (core.OFF_POLICY_CORRECTIONS entry): per-token weights from
    old_log_probs and rollout_log_probs, multiplying the policy loss; None = none."""
    pi_old_from_update: bool = False
    """log pi_old is this forward's log-probs, detached (AlgoConfig.old_log_probs="update": exact
    for a one-step update, whose forward runs with the weights the batch's pi_old names)."""
    needs = ("log_probs", "entropy")

    def weight(self, batch) -> float:
        """This micro-batch's share of a step: its tokens for a token mean, else its rows."""
        return token_weight(batch, self.loss_agg_mode)

    def __call__(self, outputs, batch):
        log_probs, entropy = outputs["log_probs"], outputs["entropy"]
        mask = batch["response_mask"]
        fresh = {"log_probs": log_probs, "entropy": entropy}  # before the batch's stale columns
        corrected: dict = {}
        if self.pi_old_from_update:
            fresh["old_log_probs"] = log_probs.detach()
            if "rollout_log_probs" in batch:  # the weight-sync check the driver makes from a recompute
                diff = core.rollout_logprob_diff(batch["rollout_log_probs"], fresh["old_log_probs"], mask)
                corrected["actor/rollout_logprob_diff"] = diff
        if self.correction is not None:
            if "rollout_log_probs" not in batch:
                raise ValueError(
                    "an off-policy correction weighs pi_old against the behaviour policy, but the batch has "
                    "no 'rollout_log_probs' column; generate with the workbench's rollout (it writes them), "
                    "or set off_policy_correction='none'"
                )
            if "is_weights" not in inspect.signature(self.policy).parameters:
                raise ValueError(
                    f"the policy loss {getattr(self.policy, '__name__', self.policy)!r} takes no is_weights, so an "
                    "off-policy correction would be ignored; give it an `is_weights=None` parameter that multiplies "
                    "each token's loss, or set off_policy_correction='none'"
                )
            fresh["is_weights"], correction_metrics = core.call(
                self.correction, fresh, batch, self.settings, what="off-policy correction"
            )
            corrected |= correction_metrics
        pg_loss, metrics = core.call(self.policy, fresh, batch, self.settings, what="policy loss")
        metrics = {**metrics, **corrected}
        loss = pg_loss
        if self.entropy_coeff:
            loss = loss - self.entropy_coeff * core.aggregate(entropy, mask, self.loss_agg_mode)
        entropy = core.aggregate(entropy.detach(), mask, self.loss_agg_mode)
        metrics = {**metrics, "actor/pg_loss": pg_loss.item(), "actor/entropy": entropy.item()}
        if self.kl_coef:
            kl = core.aggregate(self.kl_penalty(log_probs, batch["ref_log_probs"]), mask, self.loss_agg_mode)
            loss = loss + self.kl_coef * kl
            metrics |= {"actor/kl_loss": kl.item(), "actor/kl_coef": self.kl_coef}
        return loss, metrics


@dataclass
class CriticLoss:
    """PPO's clipped value loss on batch["returns"] (core.value_loss)."""

    cliprange_value: float | None = 0.5
    loss_agg_mode: str = "token-mean"
    values_key: str = "values"
    returns_key: str = "returns"
    """Which columns hold V_old and the targets (Safe-RLHF's cost critic reads cost_*)."""
    needs = ("values",)

    def weight(self, batch) -> float:
        return token_weight(batch, self.loss_agg_mode)

    def __call__(self, outputs, batch):
        values = outputs["values"]
        mask = batch["response_mask"]
        loss, clipfrac = core.value_loss(
            values, batch[self.values_key], batch[self.returns_key], mask, self.cliprange_value, self.loss_agg_mode
        )
        vpred = core.masked_mean(values.detach(), mask.float())
        return loss, {
            "critic/vf_loss": loss.item(),
            "critic/vf_clipfrac": float(clipfrac),
            "critic/vpred_mean": float(vpred),
        }


@dataclass
class PretrainLoss:
    """PPO-ptx (Ouyang et al. 2022, eq. 2): coef * next-token NLL on a text batch with
    input_ids, attention_mask and loss_mask (workbench.stages.encode_examples)."""

    coef: float = 1.0
    needs = ("nll",)

    @staticmethod
    def check(batch) -> None:
        """Refuse on the driver a batch the workers could not use."""
        needed = ("input_ids", "attention_mask", "loss_mask")
        keys = batch.keys() if hasattr(batch, "keys") else []
        if not all(k in keys for k in needed):
            raise ValueError(
                f"pre-training (ptx) rows need a Batch with {list(needed)}, got {type(batch).__name__} "
                f"with {list(keys)}; build one with "
                "workbench.stages.text_batch(tokenizer, prompts, responses, max_length)"
            )

    def __call__(self, outputs, batch):
        nll = outputs["nll"].mean()
        return self.coef * nll, {"actor/ptx_loss": nll.item()}


def token_weight(batch, loss_agg_mode: str) -> float:
    """A micro-batch's share of the step's mean (workbench.engines.accumulation): its valid
    response tokens under a token mean, its rows that have tokens under the per-row means (the
    rows those average over), its rows under seq-mean-token-sum-norm (a fixed denominator)."""
    mask = batch["response_mask"]
    if loss_agg_mode == "token-mean":
        return float(mask.sum())
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return float((mask.sum(-1) > 0).sum())
    return float(len(batch))
