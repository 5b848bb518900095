"""Per-token log-probs (and entropy) of responses under a causal LM: the one forward every
actor, reference and rollout check shares, so they agree to the last bit of the recipe.

    log_prob[t] = log_softmax(logits[t-1] / T)[token[t]]   for the R response positions
    entropy[t]  = -sum_v p_v log p_v                         of that same distribution

A real vocabulary makes the fp32 log-softmax of a whole batch (B x R x 49k for SmolLM2) the
largest tensor of a step, and autograd keeps it. From CHUNKED_VOCAB tokens up both are computed
over chunks of positions (ChunkedLogProbs): per chunk a logsumexp, the picked logit and the
entropy; the backward recomputes each chunk's softmax instead of keeping it. Beyond the logits
and their gradient, memory is then a few chunks of CHUNK_ELEMENTS fp32 values. Smaller
vocabularies (the tiny kit's 262) keep the one-shot log_softmax, bit for bit as before.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from workbench.data.batch import Batch
from workbench.engines import packing
from workbench.engines.packing import prompt_groups
from workbench.models.value import token_values
from workbench.prompt_sharing import SHARE_MIN_PARAM_TOKENS


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


def response_logits(model: torch.nn.Module, batch: Batch | dict, share_prompts: bool | None = None) -> torch.Tensor:
    """Logits that predict each response token: B x R x V.

    share_prompts: compute each distinct prompt once (`shared_prompt_logits`) where rows repeat
    one and the model can (`can_share_prompts`): True whenever so, False never, None (auto) only
    where it saves more work than its second model call costs (`SHARE_MIN_PARAM_TOKENS`)."""
    if share_prompts is not False and can_share_prompts(model):
        groups = prompt_groups(batch)
        saved = saved_prompt_tokens(batch, groups)
        share = saved > 0 and (bool(share_prompts) or saved * parameter_count(model) >= SHARE_MIN_PARAM_TOKENS)
        if agreed(model, share):
            return shared_prompt_logits(model, batch, groups)
    responses = batch["responses"]
    r = responses.shape[1]
    # Only the last r + 1 positions go through the LM head where the model can (transformers'
    # logits_to_keep): the prompt's logits were computed and dropped, 2-3x the response's with
    # chat prompts (B x 40 x 49k fp32 and its gradient for SmolLM2), and as much head matmul.
    keep = {"logits_to_keep": r + 1} if keeps_logits(model) else {}
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        **keep,
    ).logits
    return logits[:, -r - 1 : -1]


def agreed(model: torch.nn.Module, share: bool) -> bool:
    """`share` where every rank that holds a shard of `model` decides it too. Sharing makes two
    model calls instead of one, and a sharded model's forward gathers each layer's weights over
    its ranks (FSDP2, DeepSpeed ZeRO-3): ranks whose rows happen to repeat prompts differently
    must still make the same calls, or their gathers pair up wrongly and hang. One all-reduce
    (min) there; nothing elsewhere."""
    gathering = _gathering_group(model)
    if gathering is None:
        return share
    group, device = gathering
    flag = torch.tensor([int(share)], device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _gathering_group(model: torch.nn.Module):
    """(process group, device type) of the ranks that gather `model`'s weights in each forward,
    when there are several: FSDP2's mesh (its device: host-kept shards gather on the device),
    DeepSpeed ZeRO-3's data-parallel group. None for a model every rank holds whole."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if isinstance(model, FSDPModule):
        # Any unit's sharded parameter: the root's stay whole between a forward and the next
        # backward (FSDP's default for a root), so the first parameter may not be a DTensor.
        param = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
        if param is None:  # every unit gathered (a model with one FSDP unit): its state's mesh
            param = next(iter(model._get_fsdp_state()._fsdp_param_group.fsdp_params)).sharded_param
        if param.device_mesh.size() > 1:
            return param.device_mesh.get_group(), param.device_mesh.device_type
        return None
    stage = getattr(model, "zero_optimization_stage", None)  # a DeepSpeed engine
    if callable(stage) and stage() == 3 and getattr(model, "dp_world_size", 1) > 1:
        return model.data_parallel_group, torch.device(model.device).type
    return None


def shared_prompt_logits(
    model: torch.nn.Module, batch: Batch | dict, groups: tuple[int, torch.Tensor] | None = None
) -> torch.Tensor:
    """`response_logits` with each distinct prompt computed once. GRPO-style batches repeat
    every prompt n times, and chat prompts are most of a row (SmolLM2, 8 prompts x 4 samples:
    46 prompt and 16 response tokens a row), so a plain forward computes the same prompt
    positions n times, forward and backward. Here the distinct prompts run once and fill a KV
    cache; it is indexed out to every row and the responses run on it. Autograd goes through
    the indexing, so each prompt's gradient is the sum over its rows': the same step as the
    plain forward, within fp32 rounding (different matmul shapes). `groups`: `prompt_groups(batch)`
    when already known."""
    r = batch["responses"].shape[1]
    p = batch["input_ids"].shape[1] - r
    prompt = slice(0, p)
    distinct, rows = groups if groups is not None else prompt_groups(batch)
    first = torch.full((distinct,), len(rows), dtype=torch.long, device=rows.device)
    first = first.scatter_reduce(0, rows, torch.arange(len(rows), device=rows.device), "amin")
    keep = {"logits_to_keep": 1} if keeps_logits(model) else {}
    out = model(
        input_ids=batch["input_ids"][first, prompt],
        attention_mask=batch["attention_mask"][first, prompt],
        position_ids=batch["position_ids"][first, prompt],
        use_cache=True,
        **keep,
    )
    cache, first_logits = out.past_key_values, out.logits[rows, -1:]
    del out
    if r == 1:
        return first_logits
    cache.batch_select_indices(rows)  # each row's copy of its prompt's keys and values
    rest = slice(p, p + r - 1)  # the last response token predicts nothing
    logits = model(
        input_ids=batch["input_ids"][:, rest],
        attention_mask=batch["attention_mask"][:, : p + r - 1],
        position_ids=batch["position_ids"][:, rest],
        past_key_values=cache,
        use_cache=True,
    ).logits
    return torch.cat([first_logits, logits], 1)


def saved_prompt_tokens(batch: Batch | dict, groups: tuple[int, torch.Tensor] | None = None) -> int:
    """Prompt positions `shared_prompt_logits` would not compute: (rows - distinct prompts) x
    prompt columns. `groups`: `prompt_groups(batch)` when already known."""
    distinct, rows = groups if groups is not None else prompt_groups(batch)
    return (len(rows) - distinct) * (batch["input_ids"].shape[1] - batch["responses"].shape[1])


def parameter_count(model: torch.nn.Module) -> int:
    """Every parameter of `model`, sharded ones (FSDP2, tensor parallel: DTensors) at full size."""
    count = getattr(model, "_workbench_parameter_count", None)
    if count is None:
        count = sum(p.numel() for p in model.parameters())
        model._workbench_parameter_count = count  # asked at every forward
    return count


def can_share_prompts(model: torch.nn.Module) -> bool:
    """Whether `model` (DeepSpeed's `.module`, a peft wrapper, FSDP2 and tensor-parallel
    included) is a transformers causal LM that continues from a KV cache with gradients: not a
    compiled or pipeline-parallel model (other call signatures), not one that checkpoints
    activations in training (transformers turns the cache off there)."""
    from transformers import PreTrainedModel

    inner = packing.unwrap(model)
    if not isinstance(inner, PreTrainedModel) or getattr(inner, "_compiled_call_impl", None) is not None:
        return False  # not a transformers model, or compiled in place (LoadConfig.compile): one graph
    return not (inner.training and getattr(inner, "is_gradient_checkpointing", False))


def keeps_logits(model: torch.nn.Module) -> bool:
    """Whether the causal LM inside `model` (DeepSpeed's `.module`, a peft wrapper) takes
    `logits_to_keep` (transformers' own models do; remote code may not)."""
    return _forward_takes_logits_to_keep(type(packing.unwrap(model)))


@functools.cache
def _forward_takes_logits_to_keep(cls: type) -> bool:
    """Per model class, once (every training and scoring forward asks)."""
    import inspect

    try:
        return "logits_to_keep" in inspect.signature(cls.forward).parameters
    except (AttributeError, TypeError, ValueError):
        return False


CHUNKED_VOCAB = 8192
"""Vocabularies at least this large get chunked log-probs (see the module docstring)."""
CHUNK_ELEMENTS = {"cpu": 1 << 20, "other": 1 << 24}
"""fp32 values per chunk: rows per chunk = this // vocabulary size. On CPU 4 MiB chunks stay in
cache: log-probs + entropy, forward and backward, of 8 x 64 x 49,152 fp32 logits (96 MiB) took
0.36-0.44 s and 140-169 MiB above the logits (their 96 MiB gradient included), against
0.61-0.65 s and 485 MiB one-shot (2-core CPU). On accelerators 64 MiB keeps kernel launches few."""


def token_log_probs(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunked: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log_softmax(logits / T) at `tokens`, computed in fp32; optionally the entropy.
    chunked: None = by vocabulary size (CHUNKED_VOCAB), True/False to force either way."""
    if chunked if chunked is not None else logits.shape[-1] >= CHUNKED_VOCAB:
        budget = CHUNK_ELEMENTS["cpu" if logits.device.type == "cpu" else "other"]
        rows = max(1, budget // logits.shape[-1])
        picked, entropy = ChunkedLogProbs.apply(logits, tokens, float(temperature), rows, with_entropy)
        return picked, entropy if with_entropy else None
    log_p = F.log_softmax(logits.float() / temperature, dim=-1)
    picked = log_p.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1) if with_entropy else None
    return picked, entropy


class ChunkedLogProbs(torch.autograd.Function):
    """(log p(token), entropy) over `rows` positions at a time, never all of B x R x V at once.

        log p_k = z_k - logsumexp(z),   H = -sum_v p_v log p_v,   z = logits / T
        d log p_k / d z = onehot_k - p,   d H / d z = -p * (log p + H)

    Returns fp32 tensors shaped like `tokens`; the entropy is empty when not asked for."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature: float, rows: int, with_entropy: bool):
        flat, flat_tokens = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1, 1)
        n = flat.shape[0]
        picked = torch.empty(n, dtype=torch.float32, device=logits.device)
        # log p = (z - max) - log(sum exp(z - max)), in log_softmax's order of rounding
        top, norm = torch.empty_like(picked), torch.empty_like(picked)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=logits.device)
        for start in range(0, n, rows):
            end = min(start + rows, n)
            log_p = flat[start:end].float() / temperature
            top[start:end] = log_p.amax(-1)
            log_p -= top[start:end, None]
            norm[start:end] = log_p.exp().sum(-1).log_()
            log_p -= norm[start:end, None]
            picked[start:end] = log_p.gather(-1, flat_tokens[start:end]).squeeze(-1)
            if with_entropy:
                entropy[start:end] = -(log_p.exp() * log_p).sum(-1)
        ctx.save_for_backward(logits, tokens, top, norm, entropy)
        ctx.temperature, ctx.rows, ctx.with_entropy = temperature, rows, with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return picked.view(tokens.shape), entropy.view(tokens.shape) if with_entropy else entropy

    @staticmethod
    def backward(ctx, grad_picked, grad_entropy):
        logits, tokens, top, norm, entropy = ctx.saved_tensors
        flat, flat_tokens = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1, 1)
        grad_picked = grad_picked.reshape(-1, 1).float()
        grad_entropy = grad_entropy.reshape(-1, 1).float() if ctx.with_entropy else None
        grad = torch.empty_like(flat)
        for start in range(0, flat.shape[0], ctx.rows):
            end = min(start + ctx.rows, flat.shape[0])
            log_p = flat[start:end].float() / ctx.temperature - top[start:end, None] - norm[start:end, None]
            p = log_p.exp()
            g = p * -grad_picked[start:end]
            g.scatter_add_(-1, flat_tokens[start:end], grad_picked[start:end])
            if grad_entropy is not None:
                g -= p * (log_p + entropy[start:end, None]) * grad_entropy[start:end]
            grad[start:end] = g / ctx.temperature
        return grad.view(logits.shape), None, None, None, None


def response_log_probs(
    model: torch.nn.Module,
    batch: Batch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    share_prompts: bool | None = None,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs, entropy) of batch["responses"], each B x R, zero where response_mask is 0;
    share_prompts as in `response_logits`; packed: one packed forward
    (workbench.engines.packing; the caller checked `packing.refusal`)."""
    if packed:
        return packed_log_probs(model, batch, temperature, with_entropy, share_prompts)
    inputs, kept = trim_padding(batch)
    logits = response_logits(model, inputs, share_prompts)
    log_probs, entropy = token_log_probs(logits, inputs["responses"], temperature, with_entropy)
    r = batch["responses"].shape[1]
    mask = batch["response_mask"].to(log_probs.dtype)
    log_probs = pad_responses(log_probs, r) * mask
    return log_probs, pad_responses(entropy, r) * mask if entropy is not None else None


def packed_log_probs(
    model: torch.nn.Module,
    batch: Batch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    share_prompts: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_log_probs` from one packed forward: the head and the log-softmax run on the
    response_mask tokens only. Prompts are shared unless share_prompts is False (in the one
    call sharing costs nothing) or the attention is variable-length (no tree mask there)."""
    share = share_prompts is not False and packing.mode(packing.unwrap(model)) == "mask"
    packed = packing.pack(batch, share)
    keep = {"logits_to_keep": packed.reads} if keeps_logits(model) else {}
    logits = packing.packed_call(model, packed, **keep).logits[0]
    if not keep:
        logits = logits[packed.reads]
    log_probs, entropy = token_log_probs(logits, packed.targets, temperature, with_entropy)
    return packed.scatter(log_probs), packed.scatter(entropy) if entropy is not None else None


def model_outputs(
    model: torch.nn.Module,
    batch: Batch,
    needs: tuple[str, ...] = ("log_probs",),
    temperature: float = 1.0,
    share_prompts: bool | None = None,
    packed: bool = False,
) -> dict[str, torch.Tensor]:
    """What a loss's `needs` names, from forwards of `model` over `batch`: "log_probs" and
    "entropy" of the responses (at `temperature`), "values" (a value model), "nll" (pre-training
    rows). The engines' side of a training step (workbench.engines.contract.LossFn); a test or a
    notebook runs a loss in one process as loss(model_outputs(model, batch, loss.needs), batch).
    packed: log-probs and values from packed forwards (workbench.engines.packing)."""
    out = {}
    if "values" in needs:
        out["values"] = response_values(model, batch, packed)
    if "nll" in needs:
        out["nll"] = sequence_nll(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
    if "log_probs" in needs or "entropy" in needs:
        log_probs, entropy = response_log_probs(model, batch, temperature, "entropy" in needs, share_prompts, packed)
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
    if logits.shape[-1] >= CHUNKED_VOCAB:
        nll = -token_log_probs(logits, targets, chunked=True)[0]
    else:
        nll = F.cross_entropy(logits.transpose(1, 2).float(), targets, reduction="none")
    return (nll * mask).sum(1) / mask.sum(1).clamp(min=1)


def response_values(model: torch.nn.Module, batch: Batch, packed: bool = False) -> torch.Tensor:
    """V(s_t) for each response position t: the value at the token before it. B x R (zero past
    the longest response: those columns are padding in every row and are not computed; packed:
    zero at every response position that is not a real token)."""
    if packed:
        layout = packing.pack(batch, share=packing.mode(packing.unwrap(model)) == "mask", policy_only=False)
        values = packing.packed_call(model, layout).logits[0, layout.reads].squeeze(-1).float()
        return layout.scatter(values)
    inputs, kept = trim_padding(batch)
    values = token_values(model, inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"])
    return pad_responses(values[:, -kept - 1 : -1], batch["responses"].shape[1])
