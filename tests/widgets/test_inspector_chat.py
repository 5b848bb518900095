"""The batch inspector shows a chat prompt as its conversation (system, user, then the response
as the assistant's turn), and a text prompt as it is. Pure: a Batch built by hand."""

import torch

from tests.chat_kit import add_chatml
from widgets.inspector import BatchInspector
from workbench.data.batch import Batch
from workbench.models import train_tokenizer

CHAT = [
    {"role": "system", "content": "You are a careful calculator."},
    {"role": "user", "content": "What is 3 + 4? Answer with the number only."},
]


def test_a_chat_row_shows_its_conversation_and_a_text_row_its_text():
    tokenizer = add_chatml(train_tokenizer())
    responses = [
        tokenizer(" 7", add_special_tokens=False)["input_ids"],
        tokenizer(" 8", add_special_tokens=False)["input_ids"],
    ]
    width = max(map(len, responses))
    ids = torch.full((2, width), tokenizer.pad_token_id)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, row in enumerate(responses):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    batch = Batch(
        {
            "responses": ids,
            "response_mask": mask,
            "advantages": mask.float() * torch.tensor([[1.0], [-1.0]]),
            "scores": torch.tensor([1.0, 0.0]),
        },
        {"prompt": [CHAT, "Q: 3+5=? A:"], "response_text": [" 7", " 8"], "ground_truth": ["7", "8"]},
    )
    inspector = BatchInspector(batch, tokenizer, sort="none")
    chat, text = inspector.rows()
    assert chat["messages"] == [*CHAT, {"role": "assistant", "content": " 7"}]
    assert chat["prompt"] == "system: You are a careful calculator.\nuser: What is 3 + 4? Answer with the number only."
    assert text["messages"] is None and text["prompt"] == "Q: 3+5=? A:"
    html = inspector.summary()
    assert "<b>system:</b> You are a careful calculator.<br><b>user:</b> What is 3 + 4?" in html
    assert "<b>assistant:</b> <span" in html and "<code>Q: 3+5=? A:</code>" in html
    assert "{&#x27;role&#x27;" not in html and "'role'" not in html  # no list repr of the messages
