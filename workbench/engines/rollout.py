"""The contract every rollout backend meets (HF `generate`, vLLM), so workers can swap them.

Input: a Batch of prompts with left-padded `input_ids` and `attention_mask` (B x P).
Output: a Batch of B*n rows (each prompt's n samples adjacent), holding the prompt fields
repeated, plus:
  responses          B*n x R  generated token ids, right-padded with pad_token_id
  response_mask      B*n x R  1 for generated tokens (up to and including the one that ends the
                              response: an EOS or stop token id, or the token that completes a
                              stop string), 0 after
  rollout_log_probs  B*n x R  log-prob of each generated token under log_softmax(logits / T)
                              (T = temperature, 1 when greedy; before top-p/top-k truncation,
                              so training forwards reproduce it), 0 where masked
  input_ids, attention_mask, position_ids   B*n x (P+R): prompt and response joined, the
                              layout training forwards consume
R = max_new_tokens. Weights are updated in place (`load_weights`), never by restarting.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from workbench import checks
from workbench.data.batch import Batch
from workbench.errors import ConfigError


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample responses."""

    max_new_tokens: int = 32
    """Response length R (responses stop early at EOS and are padded to R)."""
    min_new_tokens: int = 0
    """Responses end no earlier (the end ids are held back until then): e.g. a baseline of an
    exact number of generated tokens."""
    stop: tuple[str, ...] = ()
    """Stop strings: a response ends at the token that completes one of them (kept, like EOS),
    e.g. ("\\n\\n",) or ("Q:",) to end a plain-text answer before the next question."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response besides the model's EOS, e.g. a chat template's end of
    turn (`<|im_end|>`) when the tokenizer's eos is another token."""
    temperature: float = 1.0
    """Softmax temperature; ignored when greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = off)."""
    n: int = 1
    """Samples per prompt (GRPO/RLOO groups); rows of one prompt are adjacent."""
    greedy: bool = False
    """Arg-max decoding (ReMax baseline, evaluation)."""
    seed: int | None = None
    """Seed for reproducible sampling; None draws fresh randomness. Algorithms derive each
    iteration's stream from (seed, iteration) and each rank's from that and its rank
    (`stream_seed`), so runs repeat exactly while iterations (and ranks) draw different samples."""

    def __post_init__(self):
        checks.whole("SamplingConfig", "max_new_tokens", self.max_new_tokens, fix="use a whole number of tokens >= 1")
        checks.whole(
            "SamplingConfig",
            "min_new_tokens",
            self.min_new_tokens,
            low=0,
            fix=f"use a whole number of tokens in [0, max_new_tokens={self.max_new_tokens}]",
        )
        if self.min_new_tokens > self.max_new_tokens:
            raise ConfigError(
                "SamplingConfig.min_new_tokens",
                self.min_new_tokens,
                f"use at most max_new_tokens={self.max_new_tokens}",
            )
        checks.whole("SamplingConfig", "n", self.n, fix="use a whole number of samples per prompt >= 1")
        checks.of_type("SamplingConfig", "greedy", self.greedy, bool, "use True or False")
        if not self.greedy:
            checks.real(
                "SamplingConfig",
                "temperature",
                self.temperature,
                0,
                low_open=True,
                fix="temperature must be > 0; use greedy=True for arg-max",
            )
        checks.real("SamplingConfig", "top_p", self.top_p, 0, 1, low_open=True, fix="use top_p in (0, 1] (1.0 = off)")
        checks.whole("SamplingConfig", "top_k", self.top_k, low=0, fix="use a whole number >= 0 (0 = off)")
        if self.seed is not None:
            checks.whole("SamplingConfig", "seed", self.seed, low=0, fix="use a whole number >= 0, or None")
        if isinstance(self.stop, str) or not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError("SamplingConfig.stop", self.stop, 'use a list of non-empty strings, e.g. ["\\n\\n"]')
        if not all(checks.is_whole(i, low=0) for i in self.stop_token_ids):
            raise ConfigError("SamplingConfig.stop_token_ids", self.stop_token_ids, "use a list of token ids >= 0")
        object.__setattr__(self, "stop", tuple(self.stop))  # lists from YAML or callers: hashable
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def end_ids(self, eos_token_id: int | list[int] | None) -> list[int]:
        """The token ids that end a response: the model's eos id(s), then stop_token_ids."""
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        return eos + [i for i in self.stop_token_ids if i not in eos]


def stream_seed(seed: int, *parts: int) -> int:
    """A seed for the random stream named by (seed, *parts), e.g. (seed, iteration) or
    (seed, rank): distinct parts give unrelated streams (no seed + 1 collisions between
    neighbouring iterations and ranks), the same parts the same stream."""
    digest = hashlib.blake2b(":".join(map(str, (seed, *parts))).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF


class RolloutEngine(Protocol):
    def generate(self, prompts: Batch, sampling: SamplingConfig) -> Batch: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the weights in place with full (unsharded) HF-named tensors."""

    def release(self) -> None:
        """Free generation-only memory (KV cache, buffers) until the next generate."""


def join_prompt_and_response(
    prompts: Batch, responses: torch.Tensor, response_mask: torch.Tensor, log_probs: torch.Tensor, n: int
) -> Batch:
    """The output layout above, from left-padded prompts and right-padded responses."""
    rows = prompts.repeat(n, interleave=True) if n > 1 else prompts
    prompt_mask = rows["attention_mask"]
    attention_mask = torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    out = Batch(
        {
            "input_ids": torch.cat([rows["input_ids"], responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "responses": responses,
            "response_mask": response_mask.to(prompt_mask.dtype),
            "rollout_log_probs": log_probs * response_mask,
        },
        rows.columns,
        rows.info,
    )
    return out


def end_token_ids(model, tokenizer) -> int | list[int]:
    """The ids that end a response of `model` (a model, or its GenerationConfig): the tokenizer's
    eos and the generation config's (an imported chat model lists its template's end of turn
    there, workbench.models.import_gguf)."""
    listed = getattr(getattr(model, "generation_config", model), "eos_token_id", None)
    listed = [] if listed is None else [listed] if isinstance(listed, int) else list(listed)
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids += [i for i in listed if i not in ids]
    return ids[0] if len(ids) == 1 else ids


def mask_after_eos(responses: torch.Tensor, eos_token_id: int | list[int]) -> torch.Tensor:
    """1 up to and including the first EOS of each row, 0 after."""
    eos = torch.as_tensor(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id], device=responses.device)
    is_eos = torch.isin(responses, eos)
    after_eos = (is_eos.cumsum(dim=1) - is_eos.long()) > 0
    return (~after_eos).long()


def mask_after_stop(responses: torch.Tensor, mask: torch.Tensor, stop: tuple[str, ...], tokenizer) -> torch.Tensor:
    """`mask` cut after the token that completes a stop string (see `first_stop`)."""
    if not stop:
        return mask
    mask = mask.clone()
    for row, (ids, kept) in enumerate(zip(responses.tolist(), mask.sum(1).tolist())):
        end = first_stop(ids[:kept], stop, tokenizer)
        if end is not None:
            mask[row, end + 1 :] = 0
    return mask


def first_stop(ids: list[int], stop: tuple[str, ...], tokenizer) -> int | None:
    """The first k whose text ids[: k + 1] contains a stop string, or None: found by bisection
    (containing one is monotone in k), so a row costs log2(R) decodes; two where the stop string
    ends at the last id, as an engine that stopped on it leaves it."""

    def stopped(k: int) -> bool:
        text = tokenizer.decode(ids[: k + 1], skip_special_tokens=False)
        return any(s in text for s in stop)

    if not ids or not stopped(len(ids) - 1):
        return None
    if len(ids) == 1 or not stopped(len(ids) - 2):
        return len(ids) - 1
    low, high = 0, len(ids) - 2  # the first stopping token lies in [low, high]
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if stopped(middle) else (middle + 1, high)
    return low


def response_texts(batch: Batch, tokenizer) -> list[str]:
    """Text of each response through its EOS, special tokens dropped (what rule rewards read)."""
    mask = batch["response_mask"]
    tokens = batch["responses"] * mask + tokenizer.pad_token_id * (1 - mask)
    return tokenizer.batch_decode(tokens, skip_special_tokens=True)
