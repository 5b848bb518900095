"""Model kit: load any local Hugging Face causal-LM directory, import a GGUF file as one, and the
built-in tiny kit."""

from workbench.models.gguf_import import GGUFImportError, end_of_turn_ids, import_gguf, resolve_gguf
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
from workbench.models.lora import LoRAConfig
from workbench.models.tiny import SIZES, TinySize, count_parameters, make_tiny, tiny_config, train_tokenizer

__all__ = [
    "SIZES",
    "GGUFImportError",
    "LoadConfig",
    "LoRAConfig",
    "LoadedModel",
    "ModelLoadError",
    "TinySize",
    "check_causal_lm",
    "count_parameters",
    "end_of_turn_ids",
    "ensure_pad_token",
    "import_gguf",
    "load",
    "load_config",
    "load_tokenizer",
    "make_tiny",
    "resolve_dtype",
    "resolve_gguf",
    "save",
    "tiny_config",
    "train_tokenizer",
]
