"""Model kit: load any local Hugging Face causal-LM directory, and the built-in tiny kit."""

from workbench.models.load import (
    LoadConfig,
    LoadedModel,
    ModelLoadError,
    check_causal_lm,
    ensure_pad_token,
    load,
    load_config,
    load_tokenizer,
    resolve_dtype,
    save,
)
from workbench.models.tiny import SIZES, TinySize, count_parameters, make_tiny, tiny_config, train_tokenizer

__all__ = [
    "SIZES",
    "LoadConfig",
    "LoadedModel",
    "ModelLoadError",
    "TinySize",
    "check_causal_lm",
    "count_parameters",
    "ensure_pad_token",
    "load",
    "load_config",
    "load_tokenizer",
    "make_tiny",
    "resolve_dtype",
    "save",
    "tiny_config",
    "train_tokenizer",
]
