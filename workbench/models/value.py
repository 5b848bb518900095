"""Value models: a decoder LM backbone with a scalar head per token (critic, reward, cost).

Loaded as `AutoModelForTokenClassification(num_labels=1)`: from a causal-LM checkpoint the
backbone is reused and the head starts fresh; from a saved value model (a trained reward or
cost model) everything is restored. A sequence score is the head's output at the last real
token, which we pick from the attention mask ourselves (HF's sequence-classification heads
look for the last non-pad id, which breaks with left padding).
"""

from __future__ import annotations

import os
import warnings

import torch

from workbench.models.load import (
    LoadConfig,
    LoadedModel,
    ModelLoadError,
    check_directory,
    enable_gradient_checkpointing,
    load_tokenizer,
    resolve_dtype,
)


def load_value_model(path: str | os.PathLike, cfg: LoadConfig | None = None) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    cfg = cfg or LoadConfig()
    path = check_directory(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    if config.model_type not in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
        raise ModelLoadError(
            f"{str(path)!r} (model_type={config.model_type!r}) has no token-classification class "
            f"in transformers, so no value head can be put on it; use a Llama-style checkpoint"
        )
    config.num_labels = 1
    config.classifier_dropout = 0.0  # the head's default 0.1 would make V in training differ from V_old
    tokenizer, fixes = load_tokenizer(path, cfg)
    from transformers.utils import logging as hf_logging

    # From an LM checkpoint, "lm_head unexpected, score head newly initialised" is the point.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForTokenClassification.from_pretrained(
                path, config=config, dtype=resolve_dtype(cfg.dtype, cfg.device), trust_remote_code=cfg.trust_remote_code
            )
    finally:
        hf_logging.set_verbosity(verbosity)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    enable_gradient_checkpointing(model, cfg, path)
    return LoadedModel(model.to(cfg.device).eval(), tokenizer, path, fixes)


def token_values(model: torch.nn.Module, input_ids, attention_mask, position_ids) -> torch.Tensor:
    """The head's scalar per position: B x T."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
    return out.logits.squeeze(-1).float()


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last attended position of each row (prompts left-, responses right-padded)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(dim=1)
