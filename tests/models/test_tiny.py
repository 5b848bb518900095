import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from workbench.data.arithmetic import ArithmeticConfig, corpus, generate
from workbench.models import SIZES, TinySize, count_parameters, load, make_tiny, train_tokenizer
from workbench.models.tiny import MANIFEST

NOMINAL = {"1m": 1e6, "10m": 10e6, "30m": 30e6}


@pytest.mark.parametrize(
    "text",
    [
        "Q: 37+48=? A: 85",
        "Q: 1234*56-7=? A: 69097",
        "Q: 5-90=? A: -85",
        "  spaces,\ttabs\nand newlines  ",
        "Natalia sold clips to 48 of her friends. Ünïcödé → 数字 🙂",
        "",
    ],
)
def test_tokenizer_round_trips_any_text(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.unk_token_id is None or tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_every_digit_is_one_token_wherever_it_stands(tokenizer):
    for problem in generate(ArithmeticConfig(digits=4, operations=("+", "-", "*"), num_operands=3), 50, seed=1):
        text = problem.prompt + " " + problem.ground_truth
        tokens = tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])
        digit_tokens = [t for t in tokens if any(c.isdigit() for c in t)]
        assert all(len(t) == 1 for t in digit_tokens), digit_tokens
        assert len(digit_tokens) == sum(c.isdigit() for c in text)


def test_special_tokens_are_distinct(tokenizer):
    ids = {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id}
    assert None not in ids and len(ids) == 3
    assert tokenizer.padding_side == "left"


def test_tokenizer_training_is_deterministic(tokenizer):
    again = train_tokenizer(corpus())
    assert again.get_vocab() == tokenizer.get_vocab()


@pytest.mark.parametrize("size", sorted(SIZES))
def test_sizes_are_within_30_percent_of_nominal(size, tokenizer):
    count = count_parameters(size, tokenizer)
    assert abs(count - NOMINAL[size]) / NOMINAL[size] <= 0.30, f"{size}: {count:,} parameters"


def test_checkpoint_loads_with_plain_transformers(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == len(tok)
    assert model.config.pad_token_id == tok.pad_token_id
    assert sum(p.numel() for p in model.parameters()) == count_parameters("1m")


def test_same_seed_same_weights_and_rng_untouched(tmp_path, tiny_dir):
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    other = make_tiny("1m", tmp_path / "again", seed=0)
    assert torch.equal(torch.rand(3), before)  # make_tiny used a private RNG stream
    a, b = load(tiny_dir).model.state_dict(), load(other).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = load(make_tiny("1m", tmp_path / "seed1", seed=1)).model.state_dict()
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_make_tiny_reuses_a_matching_directory(tiny_dir):
    weights = tiny_dir / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert make_tiny("1m", tiny_dir, seed=0) == tiny_dir
    assert weights.stat().st_mtime_ns == stamp
    assert json.loads((tiny_dir / MANIFEST).read_text())["seed"] == 0


def test_make_tiny_refuses_a_different_kit_unless_overwrite(tmp_path):
    micro = TinySize(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    path = make_tiny(micro, tmp_path / "m", seed=0)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        make_tiny(micro, path, seed=1)
    make_tiny(micro, path, seed=1, overwrite=True)
    assert json.loads((path / MANIFEST).read_text())["seed"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left over
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes.txt"):
        make_tiny(micro, tmp_path / "other")


def test_unknown_size_names_the_choices():
    with pytest.raises(ValueError, match="1m"):
        make_tiny("7b", "/nonexistent")


def test_the_chat_kit_renders_chats_and_ends_a_turn_at_im_end(tmp_path, tiny_dir):
    from workbench.data import tool_multiply
    from workbench.engines.rollout import end_token_ids

    chat_dir = make_tiny("1m", tmp_path / "chat", seed=0, chat=True)
    assert make_tiny("1m", chat_dir, seed=0, chat=True) == chat_dir  # cached apart from the plain kit
    with pytest.raises(FileExistsError):
        make_tiny("1m", chat_dir, seed=0)  # the plain kit is another kit
    loaded = load(chat_dir)
    tok, model = loaded.tokenizer, loaded.model
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end_token_ids(model, tok) == [tok.eos_token_id, end]
    assert model.get_input_embeddings().num_embeddings == len(tok)
    chat = tool_multiply.demonstration(tool_multiply.generate(tool_multiply.MultiplyConfig(), 1)[0])
    text = tok.apply_chat_template(chat, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>tool\n" in text
    # Trained on the task's chats too: a tool call is a few dozen tokens, not one per byte.
    assert len(tok.encode(chat[2]["content"], add_special_tokens=False)) < len(chat[2]["content"]) / 2
    plain = load(tiny_dir).tokenizer
    assert plain.chat_template is None and len(plain) < len(tok)
