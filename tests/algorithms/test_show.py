"""rollout_table: the compact text view of a batch."""

import torch

from algorithms import rollout_table
from workbench import Batch


def test_rollout_table_shows_a_chat_prompt_by_its_question():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    batch = Batch({"response_mask": torch.ones(2, 3)}, {"prompt": [chat, "Q: 2+3=? A:"]})
    lines = rollout_table(batch, width=40).splitlines()
    assert "'What is 2 + 3?'" in lines[1] and "'Q: 2+3=? A:'" in lines[2]
