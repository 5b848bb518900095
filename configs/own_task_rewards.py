"""The rewards of configs/own_task.yaml, as a researcher would write them: a file of plain
functions, named in the config by path (`configs/own_task_rewards.py:correct`).

correct  the reasoning-gym dataset's own scorer (reasoning_gym.get_score_answer_fn) on the
         response's last number, counted right only at full marks
final    1 for a response that ends on a number (its final answer, `4 + 9 = 13` or `13.`): a
         format reward
"""

import re

from reasoning_gym import get_score_answer_fn

NUMBER = re.compile(r"-?\d+")


def correct(response: str, ground_truth: str, question: str, metadata: dict) -> float:
    numbers = NUMBER.findall(response)
    if not numbers:
        return 0.0
    entry = {"question": question, "answer": ground_truth, "metadata": metadata}
    return float(get_score_answer_fn(metadata["source_dataset"])(numbers[-1], entry) >= 1.0)


def final(response: str, ground_truth: str) -> float:
    return float(re.search(r"-?\d+\s*\.?\s*$", response) is not None)
