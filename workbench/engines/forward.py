"""Per-token log-probs (and entropy) of responses under a causal LM: the one forward every
actor, reference and rollout check shares, so they agree to the last bit of the recipe.

    log_prob[t] = log_softmax(logits[t-1] / T)[token[t]]   for the R response positions
    entropy[t]  = -sum_v p_v log p_v                         of that same distribution
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.data.batch import Batch
from workbench.models.value import token_values


def trim_padding(batch: Batch) -> tuple[dict[str, torch.Tensor], int]:
    """The forward's inputs without the columns that are padding in every row — prompt columns
    before the longest prompt, response columns after the longest response — and how many
    response columns are kept (R' <= R). A batch of short responses then costs less than a
    batch of long ones. Exact: attention never sees padding and positions are explicit."""
    attention = batch["attention_mask"]
    r = batch["responses"].shape[1]
    prompt_len = attention.shape[1] - r
    used = attention.bool().any(0)
    lead = int(used[:prompt_len].long().argmax()) if bool(used[:prompt_len].any()) else prompt_len
    kept = int(batch["response_mask"].bool().any(0).nonzero().max()) + 1 if bool(batch["response_mask"].any()) else 1
    end = prompt_len + kept
    # Fresh copies, never views: a compiled forward (LoadConfig.compile) guards on strides and
    # on a view's base, so a slice (or a `.contiguous()` that returns the slice itself when no
    # column is trimmed) would make it recompile whenever the trimming changes.
    inputs = {k: _fresh(batch[k][:, lead:end]) for k in ("input_ids", "attention_mask", "position_ids")}
    inputs["responses"] = _fresh(batch["responses"][:, :kept])
    return inputs, kept


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that is not a view of anything."""
    return t.clone(memory_format=torch.contiguous_format)


def pad_responses(values: torch.Tensor, r: int) -> torch.Tensor:
    """B x R' -> B x R with zeros at the dropped (padding) response positions."""
    return torch.nn.functional.pad(values, (0, r - values.shape[1])) if values.shape[1] < r else values


def response_logits(model: torch.nn.Module, batch: Batch | dict) -> torch.Tensor:
    """Logits that predict each response token: B x R x V."""
    responses = batch["responses"]
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits
    r = responses.shape[1]
    return logits[:, -r - 1 : -1]


def token_log_probs(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(logits / T) at `tokens`, computed in fp32; optionally the entropy."""
    log_p = F.log_softmax(logits.float() / temperature, dim=-1)
    picked = log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1) if with_entropy else None
    return picked, entropy


def response_log_probs(
    model: torch.nn.Module, batch: Batch, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs, entropy) of batch["responses"], each B x R, zero where response_mask is 0."""
    inputs, kept = trim_padding(batch)
    logits = response_logits(model, inputs)
    log_probs, entropy = token_log_probs(logits, inputs["responses"], temperature, with_entropy)
    r = batch["responses"].shape[1]
    mask = batch["response_mask"].to(log_probs.dtype)
    log_probs = pad_responses(log_probs, r) * mask
    return log_probs, pad_responses(entropy, r) * mask if entropy is not None else None


def model_outputs(
    model: torch.nn.Module, batch: Batch, needs: tuple[str, ...] = ("log_probs",), temperature: float = 1.0
) -> dict[str, torch.Tensor]:
    """What a loss's `needs` names, from forwards of `model` over `batch`: "log_probs" and
    "entropy" of the responses (at `temperature`), "values" (a value model), "nll" (pre-training
    rows). The engines' side of a training step (workbench.engines.contract.LossFn); a test or a
    notebook runs a loss in one process as loss(model_outputs(model, batch, loss.needs), batch)."""
    out = {}
    if "values" in needs:
        out["values"] = response_values(model, batch)
    if "nll" in needs:
        out["nll"] = sequence_nll(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
    if "log_probs" in needs or "entropy" in needs:
        log_probs, entropy = response_log_probs(model, batch, temperature, with_entropy="entropy" in needs)
        out["log_probs"] = log_probs
        if entropy is not None:
            out["entropy"] = entropy
    return out


def sequence_nll(model: torch.nn.Module, input_ids, attention_mask, loss_mask) -> torch.Tensor:
    """Per-row mean next-token cross-entropy over the positions loss_mask marks: B.

    The pre-training (PPO-ptx) loss of a right-padded text batch, e.g. from
    workbench.stages.encode_examples."""
    logits = model(input_ids=_fresh(input_ids), attention_mask=_fresh(attention_mask)).logits[
        :, :-1
    ]  # see trim_padding
    targets, mask = input_ids[:, 1:], loss_mask[:, 1:].float()
    nll = F.cross_entropy(logits.transpose(1, 2).float(), targets, reduction="none")
    return (nll * mask).sum(1) / mask.sum(1).clamp(min=1)


def response_values(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """V(s_t) for each response position t: the value at the token before it. B x R (zero past
    the longest response: those columns are padding in every row and are not computed)."""
    inputs, kept = trim_padding(batch)
    values = token_values(model, inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"])
    return pad_responses(values[:, -kept - 1 : -1], batch["responses"].shape[1])
