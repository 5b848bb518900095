"""Test helpers for real-model paths without a download: the tiny kit with a ChatML template
(`<|im_start|>` / `<|im_end|>` added as special tokens), and a GGUF file written from any HF
Llama directory the way llama.cpp's converter writes one (fp32 tensors, q/k rows permuted, a
byte-level BPE tokenizer as `tokenizer.ggml.*` metadata)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from workbench.models import make_tiny

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
END_OF_TURN = "<|im_end|>"


def add_chatml(tokenizer):
    """`tokenizer` with `<|im_start|>` / `<|im_end|>` as special tokens and the ChatML template."""
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", END_OF_TURN]})
    tokenizer.chat_template = CHATML
    return tokenizer


def make_tiny_chat(directory: Path, seed: int = 0) -> Path:
    """The 1m tiny kit plus ChatML: two special tokens (embedding rows appended), the template,
    and a generation config whose eos is `<|im_end|>`. Cached like make_tiny."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = Path(directory)
    if (directory / "config.json").exists():
        return directory
    base = make_tiny("1m", directory.parent / f"{directory.name}-base", seed=seed)
    tokenizer = add_chatml(AutoTokenizer.from_pretrained(base))
    model = AutoModelForCausalLM.from_pretrained(base)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


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
