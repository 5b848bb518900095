"""Reward-model training: Bradley–Terry on preference pairs (Ouyang et al. 2022, §3.5),
loss = -log sigmoid(r(prompt, chosen) - r(prompt, rejected)), with r the value head's output
at the last token. The same function trains a Safe-RLHF cost model (pairs where the unsafe
answer is "chosen" to cost more).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from workbench.models.value import last_token_index, load_value_model, token_values
from workbench.stages.sft import StageConfig, encode_examples, fit


def sequence_scores(model, tokenizer, prompts: list[str], responses: list[str], max_length: int) -> torch.Tensor:
    input_ids, attention_mask, _ = encode_examples(tokenizer, prompts, responses, max_length)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    values = token_values(model, input_ids, attention_mask, position_ids)
    return values[torch.arange(len(values)), last_token_index(attention_mask)]


def pairwise_accuracy(model, tokenizer, pairs: list[dict], max_length: int = 64) -> float:
    """Fraction of pairs whose chosen answer scores above the rejected one."""
    with torch.no_grad():
        prompts = [p["prompt"] for p in pairs]
        chosen = sequence_scores(model, tokenizer, prompts, [p["chosen"] for p in pairs], max_length)
        rejected = sequence_scores(model, tokenizer, prompts, [p["rejected"] for p in pairs], max_length)
    return float((chosen > rejected).float().mean())


def train_reward_model(
    model_dir: str | Path, pairs: list[dict], out_dir: str | Path, config: StageConfig = StageConfig()
) -> dict:
    """Train on rows {"prompt", "chosen", "rejected"}; saves a value model (load it with
    workbench.models.value.load_value_model, or as RewardModelWorker/CostModelWorker's model_path)."""
    loaded = load_value_model(model_dir)
    model, tokenizer = loaded.model, loaded.tokenizer

    def batch_loss(rows: list[int]) -> torch.Tensor:
        batch = [pairs[i] for i in rows]
        prompts = [p["prompt"] for p in batch]
        responses = [p["chosen"] for p in batch] + [p["rejected"] for p in batch]
        scores = sequence_scores(model, tokenizer, prompts + prompts, responses, config.max_length)
        return -F.logsigmoid(scores[: len(batch)] - scores[len(batch) :]).mean()

    losses = fit(model, config, len(pairs), batch_loss, "reward model")
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return {"path": str(out_dir), "losses": losses}
