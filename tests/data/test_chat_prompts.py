"""Chat prompts: lists of messages rendered with the tokenizer's chat template into the same
left-padded Batch layout as text prompts."""

import pytest
import torch

from tests.chat_kit import add_chatml
from workbench.data import PromptDataError, PromptLoader, PromptLoaderConfig, load_prompts, write_jsonl
from workbench.data.prompts import prompt_ids, render_prompt, tokenize_prompts
from workbench.models import train_tokenizer

CHAT = [
    {"role": "system", "content": "Answer with the number only."},
    {"role": "user", "content": "What is 12 + 7?"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return add_chatml(train_tokenizer())


def test_a_chat_renders_as_apply_chat_template_token_for_token(tokenizer):
    expected = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt_ids(CHAT, tokenizer) == list(expected)
    text = render_prompt(CHAT, tokenizer)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n") and "What is 12 + 7?" in text
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == list(expected)
    # the template's markers are single special tokens, never cut into bytes
    assert prompt_ids(CHAT, tokenizer).count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3


def test_chat_and_text_rows_share_the_left_padded_layout(tokenizer):
    rows = [
        {"prompt": CHAT, "ground_truth": "19"},
        {"prompt": "Q: 1+2=? A:", "ground_truth": "3"},
        {"prompt": CHAT[1:], "ground_truth": "19", "uid": "short-chat"},
    ]
    batch = tokenize_prompts(rows, tokenizer, max_prompt_length=128)
    ids = [prompt_ids(r["prompt"], tokenizer) for r in rows]
    width = max(map(len, ids))
    assert batch["input_ids"].shape == (3, width)
    for i, row_ids in enumerate(ids):
        assert batch["input_ids"][i, width - len(row_ids) :].tolist() == row_ids
        assert batch["attention_mask"][i].sum() == len(row_ids)
        assert batch["input_ids"][i, : width - len(row_ids)].eq(tokenizer.pad_token_id).all()
    assert batch["position_ids"][0, -1] == len(ids[0]) - 1
    assert list(batch["prompt"]) == [CHAT, "Q: 1+2=? A:", CHAT[1:]] and list(batch["uid"]) == ["0", "1", "short-chat"]
    assert list(batch.repeat(2)["prompt"])[:2] == [CHAT, CHAT]  # the messages travel with their rows


def test_chat_rows_from_a_file_and_overlong_chats_named(tokenizer, tmp_path):
    path = write_jsonl([{"prompt": CHAT, "ground_truth": "19"}] * 3, tmp_path / "chat.jsonl")
    rows = load_prompts(path)
    assert rows[0]["prompt"] == CHAT
    loader = PromptLoader(rows, tokenizer, PromptLoaderConfig(batch_size=2, max_prompt_length=128, shuffle=False))
    assert torch.equal(next(iter(loader))["input_ids"][0], torch.tensor(prompt_ids(CHAT, tokenizer)))
    with pytest.raises(
        PromptDataError, match=r"row 0 is \d+ tokens, over max_prompt_length=8 \(starts '<\|im_start\|>system"
    ):
        PromptLoader(rows, tokenizer, PromptLoaderConfig(max_prompt_length=8))


@pytest.mark.parametrize(
    "prompt, message",
    [
        (7, "must be text or a list of chat messages.*got int"),
        ([], "got an empty list"),
        ([{"role": "user"}], "message 0: .* needs a text 'role'.*and a text 'content'"),
        (["hello"], "message 0: 'hello' is not a chat message"),
    ],
)
def test_malformed_prompts_are_named(tmp_path, prompt, message):
    path = write_jsonl([{"prompt": prompt, "ground_truth": "1"}], tmp_path / "bad.jsonl")
    with pytest.raises(PromptDataError, match=f"bad.jsonl' row 0: 'prompt'.*{message}"):
        load_prompts(path)


def test_a_chat_without_a_template_says_how_to_get_one():
    with pytest.raises(PromptDataError, match="this one has none.*import_gguf.*tokenizer.chat_template"):
        tokenize_prompts([{"prompt": CHAT, "ground_truth": "19"}], train_tokenizer(), 64)
