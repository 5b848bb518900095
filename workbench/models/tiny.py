"""The tiny kit: a tokenizer and Llama-architecture models made here, with no download.

`make_tiny("1m", dir)` writes a normal Hugging Face checkpoint directory (config, random-init
safetensors weights, tokenizer), so everything downstream loads it exactly as it would load a
real checkpoint (`workbench.models.load`, `AutoModelForCausalLM.from_pretrained`, vLLM).

The tokenizer is byte-level BPE trained with `tokenizers` on arithmetic-task text: every
byte is in its alphabet (any text encodes, nothing is <unk>), and digits are split off
before BPE so each digit is always exactly one token.

`make_tiny(size, dir, chat=True)` is the chat kit: the same models with a ChatML template
(`<|im_start|>` / `<|im_end|>` special tokens, a tool role) and a generation config that ends a
turn at `<|im_end|>`, its tokenizer also trained on the tool task's chat text (a tool call's
JSON is a few merged tokens, not a hundred bytes). Chat prompts, multi-turn episodes and their
SFT run on it exactly as on an imported chat model.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from workbench.data import tool_multiply
from workbench.data.arithmetic import corpus
from workbench.models.publish import publish, read_manifest

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
KIT_VERSION = 1  # bump when the tokenizer recipe or init changes: cached dirs are rebuilt
MANIFEST = "tiny_kit.json"

START_OF_TURN, END_OF_TURN = "<|im_start|>", "<|im_end|>"
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The chat kit's template (ChatML, as SmolLM2 and Qwen write it): any role, tool included."""


@dataclass(frozen=True)
class TinySize:
    """Shape of one tiny Llama (parameter count also depends on the tokenizer's vocab)."""

    hidden_size: int
    """Model width d."""
    num_layers: int
    """Decoder blocks."""
    num_heads: int
    """Attention heads (head_dim = hidden_size / num_heads)."""
    num_kv_heads: int
    """Key/value heads (< num_heads is grouped-query attention)."""
    intermediate_size: int
    """SwiGLU hidden width."""
    max_positions: int = 512
    """Longest sequence (RoPE table length)."""


# Counts are with the default tokenizer (262 tokens); count_parameters() gives them exactly.
SIZES: dict[str, TinySize] = {
    # 871,040 parameters: the size for unit tests and quick notebook runs
    "1m": TinySize(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=352),
    # 10,823,040: the size for rollout benchmarks (engines differ only from ~10M up)
    "10m": TinySize(hidden_size=384, num_layers=6, num_heads=6, num_kv_heads=6, intermediate_size=1024),
    # 30,425,600: the largest, for learning runs where 1m is too small
    "30m": TinySize(hidden_size=512, num_layers=10, num_heads=8, num_kv_heads=8, intermediate_size=1280),
}


def train_tokenizer(texts: list[str] | None = None, vocab_size: int = 512):
    """A byte-level BPE tokenizer as a `transformers.PreTrainedTokenizerFast`.

    Adds <s> in front of every encoded text (Llama convention); <pad> and </s> are separate
    special tokens, so padding never looks like an end of sequence. Deterministic: the same
    texts give the same vocabulary. `vocab_size` is an upper bound: arithmetic text has few
    merges worth learning, so the default corpus gives 262 tokens (256 bytes, 3 specials, 3 merges).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = corpus() if texts is None else texts
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="left"
    )


def tiny_config(size: str | TinySize, tokenizer):
    """A `LlamaConfig` for a named size (see SIZES) or a custom TinySize."""
    from transformers import LlamaConfig

    shape = _size(size)
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )


def count_parameters(size: str | TinySize, tokenizer=None) -> int:
    """Parameters of a tiny model, counted on the meta device (no memory, no init time)."""
    from transformers import LlamaForCausalLM

    config = tiny_config(size, tokenizer if tokenizer is not None else train_tokenizer())
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


def add_chatml(tokenizer):
    """`tokenizer` with `<|im_start|>` / `<|im_end|>` as special tokens and the ChatML template."""
    tokenizer.add_special_tokens({"additional_special_tokens": [START_OF_TURN, END_OF_TURN]})
    tokenizer.chat_template = CHATML
    return tokenizer


def make_tiny(
    size: str | TinySize, directory: str | os.PathLike, seed: int = 0, overwrite: bool = False, chat: bool = False
) -> Path:
    """Write a tiny model checkpoint (config + random-init weights + tokenizer) to `directory`;
    with `chat=True` the chat kit (ChatML template, end of turn `<|im_end|>`, see above).

    Cached: if the directory already holds the kit for the same size and seed it is returned
    as is. A directory holding something else is refused unless `overwrite=True`. The write
    goes to a temporary sibling directory that is renamed into place, so ranks that race to
    make the same model never see a half-written checkpoint.
    """
    directory = Path(directory)
    manifest = {"kit_version": KIT_VERSION, "size": asdict(_size(size)), "seed": seed}
    if chat:  # only then: the plain kit's cached directories keep their manifest
        manifest["chat"] = True
    existing = _read_manifest(directory)
    if existing == manifest:
        return directory
    if directory.exists() and any(directory.iterdir()) and not overwrite:
        found = f"a tiny kit made with {existing}" if existing else f"files {sorted(os.listdir(directory))[:6]}"
        raise FileExistsError(
            f"make_tiny: {directory} already holds {found}, not {manifest}; "
            f"pass overwrite=True to replace it or choose another directory"
        )

    return publish(directory, manifest, MANIFEST, lambda staging: _build(size, seed, staging, chat))


def _build(size: str | TinySize, seed: int, out: Path, chat: bool = False) -> None:
    from transformers import GenerationConfig, LlamaForCausalLM

    tokenizer = add_chatml(train_tokenizer(corpus() + tool_multiply.corpus())) if chat else train_tokenizer()
    config = tiny_config(size, tokenizer)
    tokenizer.model_max_length = config.max_position_embeddings
    # A private RNG stream: the caller's torch RNG state is left untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        # A chat model's reply ends at its template's end of turn (an imported one's does too).
        eos_token_id=tokenizer.convert_tokens_to_ids(END_OF_TURN) if chat else tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _size(size: str | TinySize) -> TinySize:
    if isinstance(size, TinySize):
        return size
    if size not in SIZES:
        raise ValueError(f"unknown tiny size {size!r}; choose one of {sorted(SIZES)} or pass a TinySize")
    return SIZES[size]


def _read_manifest(directory: Path) -> dict | None:
    return read_manifest(directory, MANIFEST)
