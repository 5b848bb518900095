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


def test_several_rewards_show_per_row_and_as_curves_beside_the_score():
    """Rewards from several functions (reward/<name> columns): each row's values in the inspector,
    each one's mean beside the score in the dashboard, drawn in its figure when it first arrives."""
    from widgets.dashboard import MetricsDashboard

    tokenizer = add_chatml(train_tokenizer())
    ids = torch.tensor([tokenizer(" 7", add_special_tokens=False)["input_ids"]] * 2)
    batch = Batch(
        {
            "responses": ids,
            "response_mask": torch.ones_like(ids),
            "advantages": torch.ones(ids.shape),
            "scores": torch.tensor([1.1, 0.1]),
            "reward/correct": torch.tensor([1.0, 0.0]),
            "reward/final": torch.tensor([1.0, 1.0]),
            "reward/fallbacks": torch.tensor([0.0, 0.0]),
        },
        {"prompt": ["Q: 3+4=? A:"] * 2, "response_text": [" 7", " 8"], "ground_truth": ["7", "7"]},
    )
    inspector = BatchInspector(batch, tokenizer, sort="none")
    assert [row["rewards"] for row in inspector.rows()] == [
        {"correct": 1.0, "final": 1.0},
        {"correct": 0.0, "final": 1.0},
    ]
    assert "<td>1.1<br>correct 1<br>final 1</td>" in inspector.summary()  # the score, then each reward

    dashboard = MetricsDashboard()
    figure = dashboard.widget().children[2]._model
    metrics = {"critic/score/mean": 0.6, "reward/correct/mean": 0.5, "reward/final/mean": 1.0, "reward/fallbacks": 0.0}
    dashboard(None, None, {"iteration": 1, **metrics})
    assert dashboard.charts()["score"] == ["critic/score/mean", "reward/correct/mean", "reward/final/mean"]
    from bokeh.models import GlyphRenderer

    drawn = {r.name for r in figure.select({"type": GlyphRenderer}) if r.visible}
    assert {"reward/correct/mean", "reward/final/mean"} <= drawn
