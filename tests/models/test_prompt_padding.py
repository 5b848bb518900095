"""The prompt Batch convention (left padding, position ids counting real tokens) gives the
same next-token logits as running each prompt alone."""

import torch

from workbench.data import tokenize_prompts
from workbench.data.arithmetic import ArithmeticConfig, generate
from workbench.models import load


def test_left_padded_batch_matches_unpadded_prompts(tiny_dir):
    lm = load(tiny_dir)
    problems = generate(ArithmeticConfig(digits=4, num_operands=3, operations=("+", "*")), 4, seed=2)
    rows = [{"prompt": p.prompt, "ground_truth": p.ground_truth} for p in problems]
    batch = tokenize_prompts(rows, lm.tokenizer, max_prompt_length=64)
    assert len(set(batch["attention_mask"].sum(1).tolist())) > 1  # really padded
    with torch.no_grad():
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
        padded = lm.model(**inputs).logits[:, -1]
        for i, row in enumerate(rows):
            alone = lm.model(**lm.tokenizer(row["prompt"], return_tensors="pt")).logits[0, -1]
            torch.testing.assert_close(padded[i], alone, atol=1e-5, rtol=1e-5)
