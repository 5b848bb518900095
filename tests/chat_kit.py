"""Test helpers for real-model paths without a download: the tiny chat kit (the package's own,
`make_tiny(size, dir, chat=True)`: a ChatML template, `<|im_start|>` / `<|im_end|>` as special
tokens), and a GGUF file written from any HF Llama directory the way llama.cpp's converter writes
one (fp32 tensors, q/k rows permuted, a byte-level BPE tokenizer as `tokenizer.ggml.*` metadata)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from workbench.models.tiny import CHATML, END_OF_TURN, add_chatml, make_tiny

__all__ = ["CHATML", "END_OF_TURN", "add_chatml", "make_tiny_chat", "write_gguf"]


def make_tiny_chat(directory: Path, seed: int = 0) -> Path:
    """The 1m chat kit (cached like make_tiny)."""
    return make_tiny("1m", directory, seed=seed, chat=True)


def _permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (interleaved rotary halves); transformers undoes it on load."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_gguf(source: Path, path: Path, architecture: str = "llama", chat_template: str | None = None) -> Path:
    """`source` (an HF Llama directory) as a GGUF file; `architecture` is written as given, so a
    test can ask for one transformers cannot read."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = model.config
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    # Tokenizer: every id's token, specials marked CONTROL, the BPE merges, and the special ids.
    vocab = tokenizer.get_vocab()
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = set(tokenizer.all_special_ids)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(True)  # the kit's tokenizer puts <s> in front of every text
    template = chat_template if chat_template is not None else tokenizer.chat_template
    if template:
        writer.add_chat_template(template)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        stem, suffix = hf_name.rsplit(".", 1)
        weights = tensor.numpy()
        if "q_proj" in stem:
            weights = _permute(weights, config.num_attention_heads)
        elif "k_proj" in stem:
            weights = _permute(weights, config.num_key_value_heads)
        writer.add_tensor(f"{names.get_name(stem)}.{suffix}", np.ascontiguousarray(weights))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
