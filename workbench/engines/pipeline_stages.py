"""One pipeline stage of a Llama-architecture HF model (a causal LM or a value model): the
embedding on the first stage, a contiguous run of decoder layers, the final norm and the head
(`lm_head`, or a value model's `score`) on the last.

The stage is cut from the HF model in place, and what another stage holds is removed from it,
so the HF model's own parameter names stay global ("model.layers.5.mlp.up_proj.weight" on the
stage that holds layer 5): checkpoints, `full_weights()` and the weight sync see the names of
the unsplit model, and the stages' names never collide.
"""

from __future__ import annotations

import torch
from transformers.masking_utils import create_causal_mask

from workbench.engines.fsdp import decoder_layers
from workbench.errors import ConfigError

HEADS = ("lm_head", "score")
"""A causal LM's head and a value model's (AutoModelForTokenClassification)."""


def check_pipeline(config, pp: int, field: str = "model") -> None:
    """The model can be cut into `pp` stages: whole layers per stage, no weight shared between
    the first stage (embedding) and the last (head)."""
    layers = config.num_hidden_layers
    if layers % pp:
        raise ConfigError(
            f"{field}.num_hidden_layers",
            layers,
            f"must divide by the pipeline-parallel size pp={pp}; choose a pp that divides {layers}",
        )
    if pp > 1 and getattr(config, "tie_word_embeddings", False):
        raise ConfigError(
            f"{field}.tie_word_embeddings",
            True,
            "the embedding and the LM head would live on different pipeline stages; use an "
            "untied model (tie_word_embeddings=False) or pp=1",
        )


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """The decoder layers stage `stage` of `pp` runs (equal contiguous runs)."""
    per = num_layers // pp
    return range(stage * per, (stage + 1) * per)


def head_of(model: torch.nn.Module) -> str:
    for name in HEADS:
        if isinstance(getattr(model, name, None), torch.nn.Module):
            return name
    raise ConfigError("model", type(model).__name__, f"pipeline stages need a head named one of {HEADS}")


def output_width(model: torch.nn.Module) -> int:
    """Features per position the model returns (vocabulary size, or 1 for a value head)."""
    return getattr(model, head_of(model)).out_features


class Stage(torch.nn.Module):
    """forward(x, attention_mask, position_ids): x is input_ids on the first stage and the
    hidden states (B x T x H) elsewhere; returns hidden states, or on the last stage the head's
    output for every position (B x T x V)."""

    def __init__(self, model: torch.nn.Module, stage: int, pp: int):
        super().__init__()
        check_pipeline(model.config, pp)
        inner = model.model
        keep = stage_layers(len(decoder_layers(model)), pp, stage)
        inner.layers = torch.nn.ModuleDict({str(i): inner.layers[i] for i in keep})
        self.first, self.last = stage == 0, stage == pp - 1
        self.head_name = head_of(model)
        if not self.first:
            inner.embed_tokens = None
        if not self.last:
            inner.norm = None
            setattr(model, self.head_name, None)
        self.hf = model  # registered: its parameters are the stage's, under their global names

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        inner = self.hf.model
        hidden = self.layers(inner.embed_tokens(x) if self.first else x, attention_mask, position_ids)
        return self.head(hidden) if self.last else hidden

    def layers(self, hidden, attention_mask, position_ids, past_key_values=None, use_cache=None) -> torch.Tensor:
        """The stage's decoder layers over `hidden` (with a KV cache of those layers when
        generating: workbench.engines.pipelined_rollout)."""
        inner = self.hf.model
        mask = create_causal_mask(
            config=inner.config,
            inputs_embeds=hidden,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        rotary = inner.rotary_emb(hidden, position_ids=position_ids)
        for layer in inner.layers.values():
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_embeddings=rotary,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
            )
        return hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's final norm and head (the value model's dropout before its score)."""
        hidden = self.hf.model.norm(hidden)
        if self.head_name == "score":
            hidden = self.hf.dropout(hidden)
        return getattr(self.hf, self.head_name)(hidden)
