"""Packed forwards: a micro-batch's real tokens as one sequence, no padding computed.

A training batch is laid out B x (P + R): left-padded prompts, right-padded responses. A padded
forward computes every column of every row, and the vocabulary head (49,152 wide for SmolLM2)
every kept response column, so a 3-token answer costs what a 16-token one does. Packed, the
rows' real tokens are concatenated into one row of T tokens, each keeping its own position id,
and attention keeps them apart:

    [prompt a | resp a1 | resp a2 | prompt b | resp b1 ...]     (a prompt once for its rows)

    token i sees token j  iff  j <= i, both belong to the same prompt group, and j is that
                              prompt's or i's own row's

so every token sees exactly what it sees in the padded forward (positions are explicit), and the
outputs are the padded forward's within float rounding (other matmul shapes). With prompt
sharing (`share=True`) each distinct prompt is computed once for its rows, in the same single
model call, where `forward.shared_prompt_logits` needs two and a KV-cache copy. The model's
output is read only where a response token is predicted (`logits_to_keep` as indices: the head
runs on those positions alone), and the last response token of a row, which predicts nothing,
is not an input.

How the rule reaches attention depends on the model's attention implementation (`mode`):
- "mask": under "sdpa" each prompt group's tokens (contiguous, and seeing nothing outside their
  group) go through SDPA as one block with the rule as its mask, one plain causal block per row
  where nothing is shared (`_block_attention`, the model's attention from its first packed call
  on, SDPA itself for every other call): the attention costs the sum of the blocks' squares, as
  the padded forward's rows do, not the square of the whole sequence. Prompt sharing composes.
  ("eager" attention is refused: load with attn_implementation="sdpa", transformers' default.)
- "varlen": "flash_attention_2"/"flash_attention_3"/"kernels-..." kernels take the row starts
  from the position ids (transformers reads a restart to 0 as a new sequence) and run variable-
  length attention; no 4D mask reaches them, so each row carries its own prompt (no sharing).
Anything else — sliding-window attention, models whose mask is not plain causal, models that
are not transformers causal LMs / token classifiers, a pipeline stage — is refused by name
(`refusal`), and a worker asked for packing "where it is exact" (None) runs padded there.

A block's mask is n x n booleans for a group of n tokens (a prompt and its rows' answers); a
token budget (workbench.engines.budget) bounds the whole sequence.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BLOCKS = "workbench_packed_blocks"
"""The attention implementation of a model from its first packed call on (`_block_attention`)."""
MASK_ATTENTION = ("sdpa", BLOCKS)
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3")
PACKABLE_TYPES = ("llama", "qwen2", "qwen3", "mistral")
"""Model types whose attention is plain causal with explicit position ids (checked: llama, the
tiny kit's and SmolLM2's; the others share transformers' Llama attention and mask code)."""


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DeepSpeed's engine (`.module`) and a peft wrapper."""
    inner = getattr(model, "module", model)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def wanted(setting: bool | None, model: torch.nn.Module, owner: str) -> bool:
    """Whether forwards of `model` run packed under a config's `packing` setting: None where
    the model allows it (`refusal`), True always (refused by name where it cannot), False never."""
    if setting is False:
        return False
    why = refusal(model)
    if why is not None and setting:
        from workbench.errors import ConfigError

        raise ConfigError(f"{owner}.packing", True, f"{why}; use packing=None (packed where exact) or False")
    return why is None


def check_layout(owner: str, setting: bool | None, mesh, model_config) -> None:
    """Driver-side, before workers start: packing=True refused by name where the layout or the
    checkpoint's config already says it cannot pack (the rest is checked on the loaded model)."""
    if not setting:
        return
    why = PIPELINE if mesh.pp > 1 else _config_refusal(model_config)
    if why is not None:
        from workbench.errors import ConfigError

        raise ConfigError(f"{owner}.packing", True, f"{why}; use packing=None (packed where exact) or False")


PIPELINE = "a pipeline-parallel model's stages take 2D masks and return every position"


def _config_refusal(config) -> str | None:
    """Why a model of this config cannot pack, as far as its config says."""
    if config.model_type not in PACKABLE_TYPES:
        checked = ", ".join(PACKABLE_TYPES)
        return f"model_type {config.model_type!r} is not one whose attention packing was checked ({checked})"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"sliding-window attention (sliding_window={config.sliding_window}) sees fewer tokens than the mask says"
    return None


def refusal(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run packed forwards exactly, or None when it can."""
    from transformers import PreTrainedModel

    if getattr(model, "pipeline_parallel", False):
        return PIPELINE
    inner = unwrap(model)
    if not isinstance(inner, PreTrainedModel):
        return f"{type(inner).__name__} is not a transformers model"
    if getattr(inner, "_compiled_call_impl", None) is not None:
        return "the model is compiled in place (LoadConfig.compile): one graph per input shape"
    why = _config_refusal(inner.config)
    if why is None and mode(inner) is None:
        attention = inner.config._attn_implementation
        why = f"attention implementation {attention!r} takes neither a 4D mask nor variable-length rows"
    return why


def mode(model: torch.nn.Module) -> str | None:
    """ "mask", "varlen" or None (see the module docstring) for a transformers model."""
    attention = model.config._attn_implementation or "eager"
    if attention in MASK_ATTENTION:
        return "mask"
    if attention in VARLEN_ATTENTION or attention.startswith("kernels-"):
        return "varlen"
    return None


@dataclass
class Packed:
    """One micro-batch packed (see the module docstring)."""

    input_ids: torch.Tensor  # 1 x T
    position_ids: torch.Tensor  # 1 x T
    group: torch.Tensor  # T: the prompt group each token belongs to
    row: torch.Tensor  # T: the row each token belongs to, -1 for a shared prompt's tokens
    reads: torch.Tensor  # N: positions whose output predicts (or values) a response token
    rows: torch.Tensor  # N: that token's row in the batch
    cols: torch.Tensor  # N: its response column
    targets: torch.Tensor  # N: its token id
    shape: tuple[int, int]  # B x R of the batch's responses
    last: torch.Tensor  # B: each row's last position (set by pack(whole=True))

    def __len__(self) -> int:
        return self.input_ids.shape[1]

    def blocks(self) -> list[tuple[int, int, torch.Tensor | None]]:
        """(start, end, mask) per prompt group: its tokens are contiguous and see nothing
        outside it. mask: 1 x 1 x n x n, True where a token may attend (a shared prompt and the
        token's own row, causally); None where the block is one row (plain causal)."""
        starts = [0, *((self.group[1:] != self.group[:-1]).nonzero().squeeze(1) + 1).tolist(), len(self)]
        out = []
        for start, end in zip(starts, starts[1:]):
            row = self.row[start:end]
            if not bool((row == -1).any()):
                out.append((start, end, None))
                continue
            i = torch.arange(end - start, device=row.device)
            seen = (i[None, :] <= i[:, None]) & ((row[None, :] == -1) | (row[None, :] == row[:, None]))
            out.append((start, end, seen[None, None]))
        return out

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """N values (one per read) -> B x R, zero where nothing was read."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.rows, self.cols), values)


def prompt_groups(batch) -> tuple[int, torch.Tensor]:
    """(distinct prompts, each row's prompt index among them): rows alike in prompt token ids
    and mask share one, e.g. n samples per prompt."""
    p = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    prompts = torch.cat([batch["input_ids"][:, :p], batch["attention_mask"][:, :p]], 1)
    distinct, rows = torch.unique(prompts, dim=0, return_inverse=True)
    return len(distinct), rows


def pack(batch, share: bool, policy_only: bool = True, whole: bool = False) -> Packed:
    """Pack `batch` (input_ids, attention_mask, position_ids, responses, response_mask).

    share: each distinct prompt (ids and mask alike, as `prompt_groups`) once for its
    rows. policy_only: read only the positions of response_mask tokens (log-probs; the padded
    forward zeroes the rest), else every real response token (values). whole: every row's last
    token is an input too, and `last` holds each row's last position (a reward model's score).
    Vectorized: a few tensor ops whatever the row count (a Python loop over 64 rows cost more
    than a tiny model's forward)."""
    ids, attention = batch["input_ids"], batch["attention_mask"].bool()
    device = ids.device
    b, r = batch["responses"].shape
    c = ids.shape[1]
    p = c - r
    rows = torch.arange(b, device=device)
    columns = torch.arange(c, device=device)
    if not bool(attention[:, :p].any(1).all()):
        empty = int((~attention[:, :p].any(1)).nonzero()[0])
        raise ValueError(f"row {empty} has no prompt token: packing needs one to predict the first response token")
    if share:
        group = prompt_groups(batch)[1].to(device)
    else:
        group = rows
    # each row's group's first row: where its prompt tokens are read from
    first = torch.full((b,), b, device=device).scatter_reduce(0, group, rows, "amin")[group]
    shared = share & (torch.bincount(group, minlength=b)[group] > 1)
    # the tokens taken: a prompt once per group (its first row's), every row's response but the
    # last token (which predicts nothing) unless `whole`
    last_column = torch.where(attention, columns, -1).amax(1)
    taken = attention.clone()
    taken[:, :p] &= (first == rows)[:, None]
    if not whole:
        taken[rows, last_column] &= last_column < p  # a row without response keeps its prompt
    # packed order: by group, a group's prompt first, then each row's tokens, columns in order
    slot = torch.where(columns[None, :] < p, torch.zeros_like(rows)[:, None], rows[:, None] + 1)
    key = (group[:, None] * (b + 1) + slot) * c + columns[None, :]
    src_rows, src_cols = taken.nonzero(as_tuple=True)
    order = key[src_rows, src_cols].argsort()
    src_rows, src_cols = src_rows[order], src_cols[order]
    position = torch.full((b, c), -1, dtype=torch.long, device=device)
    position[src_rows, src_cols] = torch.arange(len(src_rows), device=device)
    # where a row's token at column k sits in the packed sequence (prompt columns: its group's)
    at = position.clone()
    at[:, :p] = position[first, :p]
    # the token before each real one in its row (-1 for the first): it predicts the next
    previous = torch.where(attention, columns, -1).cummax(1).values
    previous = torch.cat([torch.full((b, 1), -1, device=device), previous[:, :-1]], 1)
    read_mask = batch["response_mask"].bool() if policy_only else attention[:, p:]
    read_rows, read_cols = (read_mask & attention[:, p:]).nonzero(as_tuple=True)
    reads = at[read_rows, previous[read_rows, read_cols + p]]
    owner = torch.where(shared[src_rows] & (src_cols < p), -1, src_rows)
    return Packed(
        input_ids=ids[src_rows, src_cols][None],
        position_ids=batch["position_ids"][src_rows, src_cols][None],
        group=group[src_rows],
        row=owner,
        reads=reads,
        rows=read_rows,
        cols=read_cols,
        targets=batch["responses"][read_rows, read_cols],
        shape=(b, r),
        last=at[rows, last_column],
    )


def packed_call(model: torch.nn.Module, packed: Packed, **kwargs):
    """`model` over `packed`, its rows kept apart as its attention implementation needs."""
    inner = unwrap(model)
    if mode(inner) == "varlen":  # no mask: the position ids' restarts mark the rows
        return model(input_ids=packed.input_ids, position_ids=packed.position_ids, **kwargs)
    # From its first packed call on, the model's attention is BLOCKS: SDPA for any other call,
    # and set for good, since a backward that recomputes activations (gradient checkpointing)
    # runs the attention again after this call has returned.
    _register()
    inner.config._attn_implementation = BLOCKS
    return model(
        input_ids=packed.input_ids,
        position_ids=packed.position_ids,
        attention_mask=_PREPARED,
        packed_blocks=packed.blocks(),
        **kwargs,
    )


_PREPARED = torch.ones(1, 1, 1, 1, dtype=torch.bool)
"""A 4D mask passes through transformers' mask building untouched (a prepared mask); the
blocks' own masks travel beside it, as a keyword every layer hands to its attention (and
activation checkpointing keeps for the recomputation)."""


def _block_attention(module, query, key, value, attention_mask, packed_blocks=None, **kwargs):
    """SDPA over each prompt group's block of the packed sequence alone: attention costs the sum
    of the blocks' squares, not the square of their sum (8 groups of 700 tokens: 8x less)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_blocks is None:  # not a packed call: SDPA as the model had it
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    parts = []
    for start, end, mask in packed_blocks:
        block = slice(start, end)
        out, _ = sdpa_attention_forward(
            module, query[:, :, block], key[:, :, block], value[:, :, block], mask, is_causal=mask is None, **kwargs
        )
        parts.append(out)
    return torch.cat(parts, 1), None


@functools.cache
def _register() -> None:
    """BLOCKS is SDPA for any other call: one that runs while a packed call has it set (another
    thread's generation on the same weights) builds SDPA's masks and runs SDPA. Registered at
    the first packed call, not at import: the driver imports this module (the budget's prompt
    groups) and must not load transformers' attention code."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(BLOCKS, _block_attention)
    AttentionMaskInterface.register(BLOCKS, sdpa_mask)
