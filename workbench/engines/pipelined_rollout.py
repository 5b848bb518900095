"""Pipelined generation (the actor's generation layout keeps its pipeline stages: gen_pp = pp):
each rank of a pipeline group generates with its own stage's weights, the live training
tensors, so a pipelined actor generates without a copy of the whole model anywhere.

Every rank of the group runs the same HF `generate` loop over the same prompts. Its model call
runs the stages in turn: the first stage embeds the tokens, each stage runs its layers with a
KV cache of its own layers only and sends the hidden states on, and the last stage's logits are
broadcast to the group. Every rank therefore samples from the same logits with the same seed
(agreed before decoding) and picks the same tokens, with no other exchange. Shared prompts,
stop strings and multi-turn continuations work as on one process, since they are made of model
calls.

The stages run one after another for one batch (no micro-batches in flight), so a token costs
the whole model's compute plus pp-1 hops: the layout saves memory, not time; the planner prices
it so (`Simulator.generate`).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from functools import cache

import torch
import torch.distributed as dist
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from workbench.data.batch import Batch
from workbench.engines.hf_rollout import Decoded, HFRollout, HFRolloutConfig
from workbench.engines.pipeline import PipelinedModel
from workbench.engines.rollout import SamplingConfig
from workbench.errors import ConfigError


class _Pipelined:
    """The model call of a stage's HF model during generation (mixed into its class)."""

    _pp: PipelinedModel

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        past_key_values=None,
        use_cache=None,
        logits_to_keep=0,
        **_,
    ):
        pipe = self._pp
        stage, group = pipe.stage, pipe.group
        inner = stage.hf.model
        b, t = input_ids.shape
        if stage.first:
            hidden = inner.embed_tokens(input_ids)
        else:
            hidden = torch.empty(b, t, pipe.hidden, dtype=pipe.dtype, device=pipe.device)
            dist.recv(hidden, group=group, group_src=pipe.index - 1)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)  # this stage's layers
        if position_ids is None:
            seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = (torch.arange(t, device=hidden.device) + seen)[None]
        hidden = stage.layers(hidden, attention_mask, position_ids, past_key_values, use_cache)
        keep = int(logits_to_keep) or t
        if stage.last:
            logits = stage.head(hidden[:, -keep:]).contiguous()
        else:
            dist.send(hidden.contiguous(), group=group, group_dst=pipe.index + 1)
            logits = torch.empty(b, keep, pipe.width, dtype=pipe.dtype, device=pipe.device)
        dist.broadcast(logits, group=group, group_src=pipe.pp - 1)
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)


@cache
def _pipelined_class(cls: type) -> type:
    return type(f"Pipelined{cls.__name__}", (_Pipelined, cls), {})


def stage_generator(pipe: PipelinedModel) -> torch.nn.Module:
    """The HF model of `pipe`'s stage, made to generate as one pipeline with its group's other
    stages. It shares every module (and so every live weight) with the training stage; only its
    class differs. Its layers number their KV-cache entries from 0 (a stage's cache holds its
    own layers), which training forwards never read (they keep no cache)."""
    hf = pipe.hf
    gen = copy.copy(hf)  # a new object over the same modules and parameters,
    for registry in ("_modules", "_parameters", "_buffers"):  # in registries of its own
        setattr(gen, registry, dict(getattr(hf, registry)))
    gen.__class__ = _pipelined_class(type(hf))
    object.__setattr__(gen, "_pp", pipe)  # not a submodule: the stage is not the generator's to own
    layers = list(hf.model.layers.values())
    for local, layer in enumerate(layers):
        layer.self_attn.layer_idx = local
    gen.config = copy.copy(hf.config)  # generate's KV cache: one entry per layer of this stage
    gen.config.num_hidden_layers = len(layers)
    return gen


def check_pipelined_rollout(owner: str, train: bool, hf: HFRolloutConfig, model_config=None) -> None:
    """What pipelined generation needs, checked on the driver: stages that train (an actor
    that does not, a rollout group among them, receives whole weights), a dynamic KV cache,
    and layers that all attend alike (a stage's cache and mask are full causal attention's)."""
    kinds = set(getattr(model_config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(model_config, "use_sliding_window", False):
        raise ConfigError(
            f"{owner}.model_path",
            sorted(kinds),
            "pipelined generation keeps each stage's KV cache for full causal attention; a model with "
            "sliding-window layers generates with whole weights: use gen_pp=1, gen_tp=1",
        )
    if not train:
        raise ConfigError(
            f"{owner}.train",
            train,
            "pipelined generation runs on the training stages' own weights; an actor that does not train "
            "generates with whole weights: use gen_pp=1, gen_tp=1",
        )
    if hf.static:
        raise ConfigError(
            f"{owner}.hf",
            hf,
            "pipelined generation decodes with a dynamic KV cache of each stage's layers; use "
            "HFRolloutConfig(cache='dynamic', compile=False), or gen_pp=1, gen_tp=1",
        )


class PipelinedRollout(HFRollout):
    """HF rollout over a pipeline group's stages (see the module docstring)."""

    def __init__(
        self,
        pipe: PipelinedModel,
        pad_token_id,
        eos_token_id,
        config: HFRolloutConfig | None = None,
        tokenizer=None,
        tp_group=None,
    ):
        """tp_group: the stage's tensor-parallel group, when it has one (its ranks must sample
        alike too)."""
        config = config or HFRolloutConfig()
        check_pipelined_rollout("PipelinedRollout", True, config)
        super().__init__(stage_generator(pipe), pad_token_id, eos_token_id, config, tokenizer)
        self.pipe, self.tp_group = pipe, tp_group

    def generate(self, prompts: Batch, sampling: SamplingConfig) -> Batch:
        self.model.eval()  # the stage's modules are the trained ones: an update left them training
        return super().generate(prompts, sampling)

    def decode(self, input_ids, attention_mask, sampling: SamplingConfig, past_key_values=None) -> Decoded:
        # In train mode checkpointed layers drop the KV cache, and dropout is on: every call
        # starts in eval mode (the trainer sets train mode again for its own steps).
        self.model.eval()
        if sampling.seed is None and not sampling.greedy:  # every rank of the replica must draw alike
            seed = torch.randint(2**62, (1,), dtype=torch.int64).to(self.pipe.device)  # NCCL: on the device
            if self.tp_group is not None:  # first stage 0's tensor-parallel ranks, then down each pipeline
                dist.broadcast(seed, group=self.tp_group, group_src=0)
            dist.broadcast(seed, group=self.pipe.group, group_src=0)
            sampling = replace(sampling, seed=int(seed))
        return super().decode(input_ids, attention_mask, sampling, past_key_values)

    def load_weights(self, named_tensors) -> None:
        raise RuntimeError(
            "a pipelined rollout generates with the training stages' own weights: nothing is loaded into it"
        )

    def materialize(self, named_tensors) -> None:
        self.load_weights(named_tensors)
