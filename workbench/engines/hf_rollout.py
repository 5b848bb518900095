"""Rollout with Hugging Face `generate` (KV cache, left-padded prompts): the backend that is
always available, and the reference the vLLM backend is checked against.

The engine owns its own copy of the weights (the generation buffer of the hybrid engine);
`load_weights` copies full tensors into it in place.

`HFRolloutConfig(compile=True)` decodes with a static KV cache and a `torch.compile`d decoding
step (transformers' own path, here also on CPU): on the 2-core machine it takes 20-25% off a
generation, after one compilation (~20 s) per shape. Prompts are then left-padded to a multiple
of `prompt_bucket` tokens, so batches of similar prompts share one compiled shape.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch

from workbench import checks
from workbench.data.batch import Batch
from workbench.engines.forward import keeps_logits, token_log_probs
from workbench.engines.rollout import SamplingConfig, join_prompt_and_response, mask_after_eos, mask_after_stop

CACHES = ("dynamic", "static")


@dataclass
class Decoded:
    """One `HFRollout.decode`: the responses, right-padded to max_new_tokens, and what made them."""

    responses: torch.Tensor
    response_mask: torch.Tensor
    log_probs: torch.Tensor
    cache: Any
    """The KV cache at the end: every column of the layout but the last sampled token's."""
    steps: int
    """Decoding steps taken (columns generated before any padding to max_new_tokens)."""


@dataclass(frozen=True)
class HFRolloutConfig:
    """How `generate` decodes."""

    cache: str = "dynamic"
    """KV cache: "dynamic" (grows by concatenation each step) or "static" (allocated once for
    prompt + max_new_tokens; slower than dynamic without compilation on CPU)."""
    compile: bool = False
    """Compile the decoding step (implies a static cache). Worth it for long runs: the first
    generation of each new shape (rows per rank, bucketed prompt length) compiles first."""
    prompt_bucket: int = 16
    """With a static cache, prompts are left-padded to a multiple of this many tokens."""

    def __post_init__(self):
        checks.one_of("HFRolloutConfig", "cache", self.cache, CACHES)
        checks.of_type("HFRolloutConfig", "compile", self.compile, bool, "use True or False")
        checks.whole("HFRolloutConfig", "prompt_bucket", self.prompt_bucket, fix="use a whole number of tokens >= 1")

    @property
    def static(self) -> bool:
        return self.compile or self.cache == "static"


class HFRollout:
    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        eos_token_id: int | list[int],
        config: HFRolloutConfig | None = None,
        tokenizer=None,
    ):
        """eos_token_id: the id(s) that end a response (`end_token_ids` gives a model's);
        tokenizer: needed only for SamplingConfig.stop (stop strings are found in text)."""
        self.model = model.eval()
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id
        self.config = config or HFRolloutConfig()
        self.tokenizer = tokenizer
        self._stop_criteria: dict[tuple[str, ...], Any] = {}

    def _decoding(self) -> dict:
        """generate() arguments for the configured cache and compilation."""
        if not self.config.static:
            return {}
        options = {"cache_implementation": "static"}
        if self.config.compile:
            from transformers import CompileConfig

            # transformers compiles on accelerators by default; the flag asks for it on CPU too.
            compile_config = CompileConfig(
                dynamic=False, mode="default" if self.model.device.type == "cpu" else "reduce-overhead"
            )
            compile_config._compile_all_devices = True
            options["compile_config"] = compile_config
        else:
            options["disable_compile"] = True
        return options

    @torch.no_grad()
    def generate(self, prompts: Batch, sampling: SamplingConfig) -> Batch:
        input_ids, attention_mask = prompts["input_ids"], prompts["attention_mask"]
        if self.config.static:  # one compiled shape for prompts of similar length
            extra = -input_ids.shape[1] % self.config.prompt_bucket
            input_ids = torch.nn.functional.pad(input_ids, (extra, 0), value=self.pad_token_id)
            attention_mask = torch.nn.functional.pad(attention_mask, (extra, 0), value=0)
        if sampling.n > 1 and not self.config.static and input_ids.shape[1] > 1:
            decoded = self._decode_shared_prompts(input_ids, attention_mask, sampling)
        else:
            decoded = self.decode(input_ids, attention_mask, sampling)
        return join_prompt_and_response(
            prompts, decoded.responses, decoded.response_mask, decoded.log_probs, sampling.n
        )

    @torch.no_grad()
    def decode(self, input_ids, attention_mask, sampling: SamplingConfig, past_key_values=None) -> Decoded:
        """`generate` on a layout as it is: responses (max_new_tokens columns), their mask and
        log-probs, and the KV cache it ends with. `past_key_values` holds the layout's first
        columns already (a multi-turn rollout's previous turns: workbench.engines.hf_turns):
        only the rest is computed. The attention mask may have holes (0 between real tokens);
        positions count real tokens only, as a training forward's do."""
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        stopping = {}
        if sampling.stop:
            if self.tokenizer is None:
                raise ValueError(
                    f"SamplingConfig.stop={list(sampling.stop)} needs the tokenizer to find stop strings in "
                    f"text: make the rollout with HFRollout(..., tokenizer=tokenizer)"
                )
            stopping = {"stopping_criteria": self._stop_strings(sampling.stop)}
        end_ids = sampling.end_ids(self.eos_token_id)
        temperature = 1.0 if sampling.greedy else sampling.temperature
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            do_sample=not sampling.greedy,
            temperature=temperature if not sampling.greedy else None,
            top_p=sampling.top_p if not sampling.greedy else None,
            top_k=sampling.top_k if not sampling.greedy else None,
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=sampling.min_new_tokens,
            num_return_sequences=sampling.n,
            pad_token_id=self.pad_token_id,
            eos_token_id=end_ids if sampling.stop_token_ids else self.eos_token_id,
            output_logits=True,  # raw logits, before temperature and top-p/top-k
            return_dict_in_generate=True,
            **stopping,
            **self._decoding(),
        )
        prompt_len = input_ids.shape[1]
        responses = out.sequences[:, prompt_len:]
        # Step by step from generate's per-step logits: stacking them first would hold a second
        # B*n x steps x V fp32 copy (100 MiB for 32 x 16 tokens at a 49k vocabulary).
        log_probs = torch.stack(
            [
                token_log_probs(step[:, None], responses[:, t : t + 1], temperature)[0][:, 0]
                for t, step in enumerate(out.logits)
            ],
            dim=1,
        )
        cache = out.past_key_values
        del out
        missing = sampling.max_new_tokens - responses.shape[1]
        if missing:  # every row stopped early: pad to the fixed response length
            responses = torch.nn.functional.pad(responses, (0, missing), value=self.pad_token_id)
            log_probs = torch.nn.functional.pad(log_probs, (0, missing))
        response_mask = mask_after_eos(responses, end_ids)
        response_mask = mask_after_stop(responses, response_mask, sampling.stop, self.tokenizer)
        responses = torch.where(response_mask.bool(), responses, self.pad_token_id)
        return Decoded(responses, response_mask, log_probs, cache, responses.shape[1] - missing)

    def _decode_shared_prompts(self, input_ids, attention_mask, sampling: SamplingConfig) -> Decoded:
        """`decode` of n samples per prompt with each prompt computed once: generate's own
        num_return_sequences copies every prompt n times before the prefill, which at GRPO's
        short answers is most of a generation's tokens (SmolLM2, 8 chat prompts x 4 samples x
        16 tokens: ~1470 of ~2000). The prompts but their last token fill a KV cache, copied to the n rows of each;
        decoding starts from it, row for row as generate's own expansion orders them."""
        n = sampling.n
        head_ids, head_mask = input_ids[:, :-1], attention_mask[:, :-1]
        keep = {"logits_to_keep": 1} if keeps_logits(self.model) else {}
        prefill = self.model(
            input_ids=head_ids,
            attention_mask=head_mask,
            position_ids=(head_mask.cumsum(dim=1) - 1).clamp(min=0),
            use_cache=True,
            **keep,
        )
        cache = prefill.past_key_values
        del prefill
        cache.batch_repeat_interleave(n)
        return self.decode(
            input_ids.repeat_interleave(n, dim=0),
            attention_mask.repeat_interleave(n, dim=0),
            replace(sampling, n=1),
            past_key_values=cache,
        )

    def _stop_strings(self, stop: tuple[str, ...]):
        """generate's criterion for these stop strings, built once: it tabulates every token's
        text against them (~5 ms a call, each turn of a multi-turn rollout one call)."""
        from transformers import StoppingCriteriaList, StopStringCriteria

        if stop not in self._stop_criteria:
            self._stop_criteria[stop] = StoppingCriteriaList([StopStringCriteria(self.tokenizer, list(stop))])
        return self._stop_criteria[stop]

    def turns(self):
        """A multi-turn rollout's generations on this engine, each turn continuing from the KV
        cache of the one before (workbench.engines.hf_turns); None with a static cache, whose
        compiled shapes are the prompt buckets (every turn then starts afresh)."""
        from workbench.engines.hf_turns import HFTurns

        return None if self.config.static else HFTurns(self)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Every name, tied ones included: a state dict names a tied head (`lm_head.weight`) too.
        params = dict(self.model.named_parameters(remove_duplicate=False))
        params.update(dict(self.model.named_buffers(remove_duplicate=False)))
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"rollout model has no weight named {name!r}")
            params[name].copy_(tensor)

    @torch.no_grad()
    def materialize(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Give a `weightless_copy`'s parameters storage of their own, filled from `named_tensors`
        (every parameter must come): the engine's generation copy when it cannot share the
        training tensors (sharded ranks)."""
        params = dict(self.model.named_parameters())  # tied parameters once
        for param in params.values():
            param.data = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        loaded: set[str] = set()

        def noted():
            for name, tensor in named_tensors:
                loaded.add(name)
                yield name, tensor

        self.load_weights(noted())
        if missing := sorted(set(params) - loaded):
            raise KeyError(f"rollout weights {missing[:5]} were not given: they would stay uninitialised")

    @torch.no_grad()
    def share_weights(self, live: dict[str, torch.Tensor]) -> None:
        """Point every parameter at the training engine's live tensor of the same name (same
        device and shape): generation then always reads the latest weights, with no copy."""
        for name, param in self.model.named_parameters():
            if name not in live or live[name].shape != param.shape or live[name].device != param.device:
                raise KeyError(
                    f"rollout weight {name!r} has no live training tensor of shape {tuple(param.shape)} to share"
                )
            param.data = live[name]

    def release(self) -> None:
        """HF frees its KV cache when generate returns; the weights stay for the next call."""


def weightless_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `model` whose parameters hold no memory (each a one-element tensor
    expanded to its shape; tied parameters stay tied): the generation module's skeleton, whose
    parameters `HFRollout.share_weights` points at the training tensors or `materialize` fills.
    A full copy there would be freed again at once, but it would set the process's peak memory
    (one model's worth: 0.5 GiB at 135M parameters)."""
    memo = {id(p): torch.nn.Parameter(p.new_empty(()).expand(p.shape), requires_grad=False) for p in model.parameters()}
    return copy.deepcopy(model, memo)
