"""Rollout with Hugging Face `generate` (KV cache, left-padded prompts): the backend that is
always available, and the reference the vLLM backend is checked against.

The engine owns its own copy of the weights (the generation buffer of the hybrid engine);
`load_weights` copies full tensors into it in place.
"""

from __future__ import annotations

from typing import Iterable

import torch

from workbench.data.batch import Batch
from workbench.engines.forward import token_log_probs
from workbench.engines.rollout import SamplingConfig, join_prompt_and_response, mask_after_eos


class HFRollout:
    def __init__(self, model: torch.nn.Module, pad_token_id: int, eos_token_id: int | list[int]):
        self.model = model.eval()
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id

    @torch.no_grad()
    def generate(self, prompts: Batch, sampling: SamplingConfig) -> Batch:
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        temperature = 1.0 if sampling.greedy else sampling.temperature
        out = self.model.generate(
            input_ids=prompts["input_ids"],
            attention_mask=prompts["attention_mask"],
            do_sample=not sampling.greedy,
            temperature=temperature if not sampling.greedy else None,
            top_p=sampling.top_p if not sampling.greedy else None,
            top_k=sampling.top_k if not sampling.greedy else None,
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=0,
            num_return_sequences=sampling.n,
            pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_id,
            output_logits=True,  # raw logits, before temperature and top-p/top-k
            return_dict_in_generate=True,
        )
        prompt_len = prompts["input_ids"].shape[1]
        responses = out.sequences[:, prompt_len:]
        logits = torch.stack(out.logits, dim=1)  # B*n x steps x V
        log_probs, _ = token_log_probs(logits, responses, temperature)
        missing = sampling.max_new_tokens - responses.shape[1]
        if missing:  # every row stopped early: pad to the fixed response length
            responses = torch.nn.functional.pad(responses, (0, missing), value=self.pad_token_id)
            log_probs = torch.nn.functional.pad(log_probs, (0, missing))
        response_mask = mask_after_eos(responses, self.eos_token_id)
        responses = torch.where(response_mask.bool(), responses, self.pad_token_id)
        return join_prompt_and_response(prompts, responses, response_mask, log_probs, sampling.n)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"rollout model has no weight named {name!r}")
            params[name].copy_(tensor)

    @torch.no_grad()
    def share_weights(self, live: dict[str, torch.Tensor]) -> None:
        """Point every parameter at the training engine's live tensor of the same name (same
        device and shape): generation then always reads the latest weights, with no copy."""
        for name, param in self.model.named_parameters():
            if name not in live or live[name].shape != param.shape or live[name].device != param.device:
                raise KeyError(f"rollout weight {name!r} has no live training tensor of shape {tuple(param.shape)} to share")
            param.data = live[name]

    def release(self) -> None:
        """HF frees its KV cache when generate returns; the weights stay for the next call."""
