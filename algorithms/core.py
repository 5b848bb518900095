"""The numerics of RLHF: advantage estimators, KL penalties, policy/value losses, aggregation.

Every entry is a small pure function over B x R tensors (B rows, R response positions) and a
`response_mask` (1 on generated tokens up to EOS, 0 after). Estimators and policy losses live
in registries and are looked up by name *at call time*, so a notebook cell that redefines one

    @advantage("gae")
    def gae_clipped(token_level_rewards, values, response_mask, gamma=1.0, lam=1.0):
        adv, ret = gae(token_level_rewards, values, response_mask, gamma, lam)
        return adv.clamp(-2, 2), ret

changes the next iteration without restarting anything (a config may also hold the function
itself). Their arguments are bound by name: from the batch's columns first, then from the
algorithm's settings, then the function's defaults (`call`), so a new estimator simply names
what it needs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from workbench import checks
from workbench.data.batch import Batch

# ---- registries ------------------------------------------------------------------------------


class Registry:
    """Named functions of one kind; `register(name)` replaces an entry (the live-edit path)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.entries: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[Callable], Callable]:
        def add(fn: Callable) -> Callable:
            self.entries[name] = fn
            return fn

        return add

    def get(self, name_or_fn: str | Callable) -> Callable:
        if callable(name_or_fn):
            return name_or_fn
        try:
            return self.entries[name_or_fn]
        except KeyError:
            raise KeyError(
                f"no {self.kind} named {name_or_fn!r}; registered: {sorted(self.entries)}. "
                f"Define one with @{self.kind.split()[-1]}({name_or_fn!r}) or pass the function itself"
            ) from None

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __repr__(self) -> str:
        return f"Registry({self.kind}: {sorted(self.entries)})"


ADVANTAGES = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
KL_PENALTIES = Registry("KL penalty")
OFF_POLICY_CORRECTIONS = Registry("off-policy correction")
advantage, policy_loss, kl_penalty = ADVANTAGES.register, POLICY_LOSSES.register, KL_PENALTIES.register
off_policy_correction = OFF_POLICY_CORRECTIONS.register


class MissingInput(KeyError):
    """An estimator or loss needs a value that neither the batch nor the settings hold."""

    def __str__(self) -> str:
        return str(self.args[0])


def call(fn: Callable, *sources: Mapping[str, Any] | Batch, what: str = "") -> Any:
    """fn(**kwargs), each parameter taken from the first source (a Batch or a mapping) that has it (a None value
    counts as not given), else from the function's default."""
    kwargs = {}
    for param in inspect.signature(fn).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        for source in sources:
            if param.name in source and source[param.name] is not None:
                kwargs[param.name] = source[param.name]
                break
        else:
            if param.default is inspect.Parameter.empty:
                name = what or getattr(fn, "__name__", repr(fn))
                raise MissingInput(
                    f"{name} needs {param.name!r}, which is neither a batch column nor a setting "
                    f"(batch/settings hold: {sorted(set().union(*[list(s.keys()) for s in sources]))}). "
                    f"Add the step that produces it, or give it a default"
                )
    return fn(**kwargs)


# ---- masked statistics -----------------------------------------------------------------------


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean of x where mask is 1; 0 (not NaN) where nothing is unmasked."""
    return masked_sum(x, mask, dim) / (mask.sum() if dim is None else mask.sum(dim)).clamp(min=1)


def rollout_logprob_diff(rollout_log_probs: torch.Tensor, trainer_log_probs: torch.Tensor, mask) -> float:
    """Mean |rollout - trainer| log-prob over the response tokens (`actor/rollout_logprob_diff`):
    the generation weights against the training weights."""
    return float(masked_mean((rollout_log_probs - trainer_log_probs).abs(), mask.float()))


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(x, mask)
    count = mask.sum()
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased and count > 1:
        var = var * count / (count - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / std over the unmasked entries (PPO advantage normalisation); 0 where masked."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def group_ids(uid) -> torch.Tensor:
    """Integer group per row from a uid column (rows sampled from one prompt share a uid)."""
    _, inverse = np.unique(np.asarray(uid).astype(str), return_inverse=True)
    return torch.as_tensor(inverse, dtype=torch.long)


def group_stats(values: torch.Tensor, uid) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (group mean, group std (unbiased; 1 for a group of one), group size)."""
    groups = group_ids(uid)
    count = torch.zeros(int(groups.max()) + 1, dtype=values.dtype).index_add_(0, groups, torch.ones_like(values))
    total = torch.zeros_like(count).index_add_(0, groups, values)
    mean = (total / count)[groups]
    squares = torch.zeros_like(count).index_add_(0, groups, (values - mean) ** 2)
    std = torch.where(count > 1, (squares / (count - 1).clamp(min=1)).sqrt(), torch.ones_like(count))
    return mean, std[groups], count[groups]


def last_token_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """A sequence score placed on each row's last response token: the B x R reward of PPO."""
    last = (response_mask.cumsum(1) * response_mask).argmax(1)
    out = torch.zeros(response_mask.shape, dtype=scores.dtype)
    out[torch.arange(len(scores)), last] = scores
    return out * response_mask


def discounted_returns(rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t'} with t' the next response token the mask keeps: one episode a
    row. Masked tokens inside a response (a tool's output or an observation between two turns)
    are skipped, not restarted at: the return carries across them undiscounted."""
    keep = response_mask.bool()
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(keep[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    return returns * response_mask


# ---- advantage estimators: (advantages, returns), each B x R ---------------------------------


@advantage("gae")
def gae(token_level_rewards, values, response_mask, gamma: float = 1.0, lam: float = 1.0):
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16), advantages whitened.

    delta_t = r_t + gamma V_{t+1} - V_t;  A_t = sum_l (gamma lam)^l delta_{t+l};  R_t = A_t + V_t.
    V past the last token is 0, so the episode ends at EOS. "t+1" is the next token the mask keeps:
    masked tokens inside a response (tool output, observations between turns) are skipped, so
    advantages and returns carry across them instead of restarting.
    """
    mask = response_mask.to(values.dtype)
    keep = response_mask.bool()
    values = values * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros(values.shape[0], dtype=values.dtype)
    next_value = torch.zeros_like(running)
    for t in reversed(range(values.shape[1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(keep[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(keep[:, t], values[:, t], next_value)
        advantages[:, t] = running * mask[:, t]
    returns = advantages + values
    return masked_whiten(advantages, mask), returns * mask


@advantage("grpo")
def grpo(token_level_rewards, response_mask, uid, norm_adv_by_std: bool = True, epsilon: float = 1e-6):
    """GRPO outcome advantage (Shao et al. 2024, sec. 4.1.2): (r - mean_group) / std_group on
    every token of the response. norm_adv_by_std=False is Dr.GRPO (Liu et al. 2025). A group
    whose rewards are all equal gets 0; a group of one keeps its reward (mean 0, std 1)."""
    scores = token_level_rewards.sum(-1)
    mean, std, count = group_stats(scores, uid)
    mean = torch.where(count > 1, mean, torch.zeros_like(mean))
    centred = scores - mean
    adv = centred / (std + epsilon) if norm_adv_by_std else centred
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@advantage("drgrpo")
def drgrpo(token_level_rewards, response_mask, uid):
    """Dr.GRPO (Liu et al. 2025): GRPO without the std division (no difficulty bias); pair it
    with loss_agg_mode="seq-mean-token-sum-norm" (no length bias) as the paper does."""
    return grpo(token_level_rewards, response_mask, uid, norm_adv_by_std=False)


@advantage("rloo")
def rloo(token_level_rewards, response_mask, uid):
    """REINFORCE leave-one-out (Ahmadian et al. 2024): r_i - mean of the other k-1 samples
    of the same prompt = k/(k-1) (r_i - mean). A group of one keeps its reward."""
    scores = token_level_rewards.sum(-1)
    mean, _, count = group_stats(scores, uid)
    adv = torch.where(count > 1, (scores - mean) * count / (count - 1).clamp(min=1), scores)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


@advantage("remax")
def remax(token_level_rewards, response_mask, reward_baselines):
    """ReMax (Li et al. 2024, Alg. 1): return-to-go minus the greedy response's reward."""
    returns = discounted_returns(token_level_rewards, response_mask)
    adv = (returns - reward_baselines.unsqueeze(-1)) * response_mask
    return adv, returns


@advantage("reinforce_pp")
def reinforce_pp(token_level_rewards, response_mask, gamma: float = 1.0):
    """REINFORCE++ (Hu 2025): discounted return of the KL-shaped token rewards, whitened over
    the whole batch (a global baseline instead of a critic)."""
    returns = discounted_returns(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask), returns


@advantage("reinforce_pp_baseline")
def reinforce_pp_baseline(token_level_rewards, response_mask, uid):
    """REINFORCE++-baseline: subtract the prompt group's mean reward, then whiten globally."""
    scores = token_level_rewards.sum(-1)
    mean, _, count = group_stats(scores, uid)
    mean = torch.where(count > 1, mean, torch.zeros_like(mean))  # a group of one keeps its reward
    centred = (scores - mean).unsqueeze(-1) * response_mask
    return masked_whiten(centred, response_mask), centred


# ---- KL penalties: per-token estimates of KL(pi || pi_ref) from sampled tokens ----------------


@kl_penalty("k1")
def kl_k1(log_probs, ref_log_probs):
    """log pi - log pi_ref: unbiased, high variance, can be negative (Schulman 2020)."""
    return log_probs - ref_log_probs


@kl_penalty("abs")
def kl_abs(log_probs, ref_log_probs):
    return (log_probs - ref_log_probs).abs()


@kl_penalty("k2")
def kl_k2(log_probs, ref_log_probs):
    """0.5 (log pi - log pi_ref)^2 ("mse"): biased, low variance, >= 0."""
    return 0.5 * (log_probs - ref_log_probs) ** 2


@kl_penalty("k3")
def kl_k3(log_probs, ref_log_probs):
    """exp(ref - logp) - (ref - logp) - 1 ("low_var_kl", GRPO eq. 4): unbiased, >= 0;
    clamped to [-10, 10] as its exponential explodes on rare tokens."""
    delta = (ref_log_probs - log_probs).clamp(-20, 20)
    return (delta.exp() - delta - 1).clamp(-10, 10)


def kl_in_reward(token_level_scores, old_log_probs, ref_log_probs, response_mask, kl_coef: float, penalty="k1"):
    """PPO's shaped reward (Ziegler et al. 2019): r_t = score_t - beta * KL_t.
    Returns (token_level_rewards, KL_t per token, 0 where masked)."""
    kl = KL_PENALTIES.get(penalty)(old_log_probs, ref_log_probs) * response_mask
    return token_level_scores - kl_coef * kl, kl


def mean_token_kl(kl, response_mask) -> float:
    """Each row's mean KL per token, averaged over rows: what verl reports as
    actor/reward_kl_penalty and what the adaptive controller steers."""
    return float(masked_mean(kl, response_mask.to(kl.dtype), -1).mean())


@dataclass
class FixedKL:
    """A constant KL coefficient."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


@dataclass
class AdaptiveKL:
    """Ziegler et al. 2019, sec. 2.2: beta *= 1 + clip(KL/target - 1, -0.2, 0.2) * n / horizon,
    steering the measured KL towards `target`."""

    value: float
    target: float
    horizon: int = 10000

    def __post_init__(self):
        for name in ("value", "target"):  # a multiplicative update cannot leave 0
            checks.real(
                "AdaptiveKL",
                name,
                getattr(self, name),
                0,
                low_open=True,
                fix="use a positive start value and target: a multiplicative update cannot leave 0",
            )

    def update(self, current_kl: float, n_steps: int) -> None:
        error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + error * n_steps / self.horizon


@dataclass
class LagrangeMultiplier:
    """Safe-RLHF's lambda (Dai et al. 2023, eq. 9): projected gradient ascent on the constraint
    J_C <= budget: lambda <- clip(lambda + lr * (J_C - budget), 0, max_value)."""

    value: float = 1.0
    lr: float = 0.1
    budget: float = 0.0
    max_value: float = 100.0

    def update(self, mean_cost: float) -> None:
        self.value = float(np.clip(self.value + self.lr * (mean_cost - self.budget), 0.0, self.max_value))


def safe_advantages(reward_advantages, cost_advantages, lagrange: float):
    """(A_r - lambda A_c) / (1 + lambda): Safe-RLHF's combined advantage, scale-normalised."""
    return (reward_advantages - lagrange * cost_advantages) / (1 + lagrange)


# ---- loss aggregation ------------------------------------------------------------------------

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate(loss_mat: torch.Tensor, response_mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """B x R per-token losses -> a scalar.

    token-mean: every token weighs the same (DAPO); seq-mean-token-sum: sum per row, mean over
    rows that have tokens; seq-mean-token-mean: mean per row, mean over rows that have tokens
    (GRPO paper); seq-mean-token-sum-norm: sum / (rows x R), Dr.GRPO's length-unbiased form.
    Fully masked rows add nothing and never give NaN.
    """
    mask = response_mask.to(loss_mat.dtype)
    has_tokens = (mask.sum(-1) > 0).to(mask.dtype)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode == "seq-mean-token-sum":
        return masked_mean(masked_sum(loss_mat, mask, -1), has_tokens)
    if mode == "seq-mean-token-mean":
        return masked_mean(masked_mean(loss_mat, mask, -1), has_tokens)
    if mode == "seq-mean-token-sum-norm":
        return masked_sum(loss_mat, mask) / (mask.shape[0] * mask.shape[1])
    raise ValueError(f"loss_agg_mode {mode!r} is not one of {LOSS_AGG_MODES}")


# ---- policy losses: (loss, metrics) -----------------------------------------------------------


@policy_loss("ppo")
def ppo_clip(
    log_probs,
    old_log_probs,
    advantages,
    response_mask,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    is_weights: torch.Tensor | None = None,
):
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7) with separate low/high ranges
    (DAPO's clip-higher) and optional dual clip (Ye et al. 2020): for A < 0 the loss is capped
    at -c * A, so a hugely off-policy token cannot dominate the step. `is_weights` (an
    off-policy correction's, detached) multiply each token's loss."""
    ratio = (log_probs - old_log_probs).clamp(-20, 20).exp()
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    losses = torch.maximum(loss_unclipped, loss_clipped)
    clipped = (loss_clipped > loss_unclipped).float()
    mask = response_mask.float()
    metrics = {
        "actor/pg_clipfrac": masked_mean(clipped, mask).item(),
        "actor/ppo_kl": masked_mean(old_log_probs - log_probs, mask).item(),
    }
    if clip_ratio_c is not None:
        checks.real(
            "ppo_clip",
            "clip_ratio_c",
            clip_ratio_c,
            1,
            low_open=True,
            fix="the dual-clip bound must be > 1 (3.0 in Ye et al.)",
        )
        cap = -advantages * clip_ratio_c
        lower = ((advantages < 0) & (cap < losses)).float()
        losses = torch.where(advantages < 0, torch.minimum(losses, cap), losses)
        metrics["actor/pg_clipfrac_lower"] = masked_mean(lower, mask).item()
    if is_weights is not None:
        losses = losses * is_weights
    return aggregate(losses, mask, loss_agg_mode), metrics


@policy_loss("gspo")
def gspo(
    log_probs,
    old_log_probs,
    advantages,
    response_mask,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    is_weights: torch.Tensor | None = None,
):
    """GSPO (Zheng et al. 2025, eq. 7-10): one length-normalised importance ratio per sequence,
    s_i = exp(mean_t(log pi - log pi_old)), clipped as PPO's; carried to each token as
    sg[s_i] * pi / sg[pi] so the gradient is the sequence-level one. Sequence-mean of token-means.
    `is_weights` (an off-policy correction's) weight each token's term of its sequence's mean."""
    mask = response_mask.float()
    seq_log_ratio = masked_mean(log_probs - old_log_probs, mask, -1)
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + log_probs - log_probs.detach()
    ratio = token_log_ratio.clamp(max=10).exp()
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    losses = torch.maximum(loss_unclipped, loss_clipped)
    metrics = {
        "actor/pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).float(), mask).item(),
        "actor/ppo_kl": masked_mean(old_log_probs - log_probs, mask).item(),
    }
    if is_weights is not None:
        losses = losses * is_weights
    return aggregate(losses, mask, "seq-mean-token-mean"), metrics


# ---- off-policy corrections: (per-token weights or None, metrics) -------------------------------
# A batch generated by an older policy (asynchronous RL, algorithms.asynchronous) or by a rollout
# engine whose numerics differ from training's has behaviour log-probs (`rollout_log_probs`)
# that differ from the trainer's pi_old (`old_log_probs`, recomputed before the update). A
# correction turns the two into detached per-token weights on the policy loss.


def _weight_metrics(weights: torch.Tensor, raw: torch.Tensor, capped: torch.Tensor, mask: torch.Tensor, behav_kl):
    valid = mask.bool()
    return {
        "actor/is_weight_mean": masked_mean(weights, mask.float()).item(),
        "actor/is_weight_max": raw[valid].max().item() if valid.any() else 0.0,
        "actor/is_weight_min": raw[valid].min().item() if valid.any() else 0.0,
        "actor/is_capped_frac": masked_mean(capped.float(), mask.float()).item(),
        "actor/behav_kl": behav_kl.item(),
    }


@off_policy_correction("none")
def no_correction():
    """The loss as it is: the ratio is taken against pi_old alone."""
    return None, {}


@off_policy_correction("tis")
def truncated_importance_sampling(old_log_probs, rollout_log_probs, response_mask, is_cap: float | None = None):
    """Truncated importance sampling (Yao et al. 2025, "Your efficient RL framework secretly
    brings you off-policy RL training"): each token's loss times min(pi_old / pi_behav, C)."""
    if is_cap is None:
        raise ValueError("off_policy_correction='tis' truncates at is_cap: give a cap > 1 (e.g. 2.0)")
    raw = (old_log_probs - rollout_log_probs).clamp(-20, 20).exp().detach()
    capped = raw > is_cap
    weights = raw.clamp(max=is_cap)
    behav_kl = masked_mean(rollout_log_probs - old_log_probs, response_mask.float())
    return weights, _weight_metrics(weights, raw, capped, response_mask, behav_kl)


@off_policy_correction("decoupled")
def decoupled_ppo(old_log_probs, rollout_log_probs, response_mask, is_cap: float | None = None):
    """AReaL's decoupled PPO objective (Fu et al. 2025, arXiv 2505.24298): the clip is on
    pi_theta / pi_prox (pi_prox = old_log_probs, the trainer's policy before this update, which
    the policy loss already uses) and each token's loss is weighted by pi_prox / pi_behav. A token
    whose weight exceeds `is_cap` is dropped (weight 0; it still counts in the token mean's
    denominator), as AReaL's behaviour-importance-weight cap does; None keeps every token."""
    raw = (old_log_probs - rollout_log_probs).clamp(-20, 20).exp().detach()
    capped = raw > is_cap if is_cap is not None else torch.zeros_like(raw, dtype=torch.bool)
    weights = torch.where(capped, torch.zeros_like(raw), raw)
    behav_kl = masked_mean(rollout_log_probs - old_log_probs, response_mask.float())
    return weights, _weight_metrics(weights, raw, capped, response_mask, behav_kl)


def value_loss(
    values, old_values, returns, response_mask, cliprange_value: float | None = 0.5, loss_agg_mode: str = "token-mean"
):
    """0.5 max((V - R)^2, (clip(V, V_old +- c) - R)^2): PPO's clipped value loss; plain MSE
    when cliprange_value is None. Returns (loss, clip fraction)."""
    loss_raw = (values - returns) ** 2
    if cliprange_value is None:
        return 0.5 * aggregate(loss_raw, response_mask, loss_agg_mode), torch.zeros(())
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    loss_clipped = (clipped_values - returns) ** 2
    losses = torch.maximum(loss_raw, loss_clipped)
    clipfrac = masked_mean((loss_clipped > loss_raw).float(), response_mask.float())
    return 0.5 * aggregate(losses, response_mask, loss_agg_mode), clipfrac
