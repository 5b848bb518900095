"""Supervised fine-tuning: next-token cross-entropy on the response tokens of demonstrations.

A demonstration is a prompt and its response ({"prompt", "response"}: text), or a whole
multi-turn episode ({"messages": [system/user..., assistant, tool, assistant, ...]}): the
episode is rendered exactly as a multi-turn rollout holds it (workbench.engines.multi_turn.
conversation_ids: the prompt through the chat template, each assistant turn's own ids, each
tool message as the observation ids the rollout appends), and the loss covers the assistant's
tokens only, as RL's response mask does. SFT then teaches the very ids RL samples and scores.

Single process, on whatever device the model is on: the tiny sizes train in seconds to
minutes on a CPU. The result is saved as a normal Hugging Face checkpoint directory.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from workbench.data.batch import Batch
from workbench.engines.multi_turn import conversation_ids
from workbench.models.load import load, save


@dataclass(frozen=True)
class StageConfig:
    """Settings of a single-process pre-RL training stage: SFT (`train_sft`) and reward- or
    cost-model training (`train_reward_model`) take the same ones."""

    steps: int = 300
    batch_size: int = 32
    """Examples (or preference pairs) per step, drawn at random."""
    lr: float = 1e-3
    weight_decay: float = 0.0
    max_length: int = 64
    """Longest prompt + response in tokens; longer examples are refused (not cut)."""
    seed: int = 0
    log_every: int = 50
    """Print the loss every this many steps (0 = quiet)."""


def fit(
    model, config: StageConfig, num_examples: int, batch_loss: Callable[[list[int]], torch.Tensor], name: str
) -> list[float]:
    """AdamW steps on random batches of example indices; returns the loss of every step."""
    torch.manual_seed(config.seed)
    rng = random.Random(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    model.train()
    losses = []
    for step in range(config.steps):
        loss = batch_loss(rng.sample(range(num_examples), min(config.batch_size, num_examples)))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if config.log_every and step % config.log_every == 0:
            print(f"{name} step {step}: loss {loss.item():.4f}")
    model.eval()
    return losses


def encode_examples(tokenizer, prompts: list[str], responses: list[str], max_length: int, add_eos: bool = True):
    """Right-padded input_ids, attention_mask and a loss mask that covers only response tokens."""
    rows, masks = [], []
    for prompt, response in zip(prompts, responses):
        prompt_ids = tokenizer(prompt).input_ids
        ids = tokenizer(prompt + response).input_ids + ([tokenizer.eos_token_id] if add_eos else [])
        if ids[: len(prompt_ids)] != prompt_ids:
            raise ValueError(f"the tokenizer splits {prompt!r} differently once the response follows it")
        if len(ids) > max_length:
            raise ValueError(f"example of {len(ids)} tokens is longer than max_length={max_length}: {prompt!r}")
        rows.append(ids)
        masks.append([0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids)))
    return _right_padded(rows, masks, tokenizer.pad_token_id)


def encode_conversations(tokenizer, conversations: list[list[dict]], max_length: int, tool_role: str = "tool"):
    """Multi-turn episodes written as messages, rendered as the rollout holds them
    (`conversation_ids`): right-padded input_ids, attention_mask, and a loss mask on the
    assistant's tokens only (not the prompt, not the tool's replies nor the template around them)."""
    rows, masks = [], []
    for i, messages in enumerate(conversations):
        try:
            ids, policy = conversation_ids(tokenizer, messages, tool_role)
        except ValueError as err:
            raise ValueError(f"demonstration {i}: {err}") from None
        if len(ids) > max_length:
            raise ValueError(
                f"demonstration {i} is {len(ids)} tokens, longer than max_length={max_length}; raise "
                f"StageConfig.max_length"
            )
        rows.append(ids)
        masks.append(policy)
    return _right_padded(rows, masks, tokenizer.pad_token_id)


def encode_demonstrations(tokenizer, demonstrations: list[dict], max_length: int):
    """Rows {"prompt", "response"} (encode_examples) or {"messages"} (encode_conversations)."""
    if demonstrations and all("messages" in d for d in demonstrations):
        return encode_conversations(tokenizer, [d["messages"] for d in demonstrations], max_length)
    if demonstrations and all("prompt" in d and "response" in d for d in demonstrations):
        return encode_examples(
            tokenizer, [d["prompt"] for d in demonstrations], [d["response"] for d in demonstrations], max_length
        )
    raise ValueError(
        "SFT demonstrations are all {'prompt': text, 'response': text} or all {'messages': [...]} (a whole "
        "episode as chat messages); got rows with keys "
        f"{sorted({k for d in demonstrations for k in d})[:8] if demonstrations else 'none (the list is empty)'}"
    )


def _right_padded(rows: list[list[int]], masks: list[list[int]], pad: int):
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    attention_mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks])
    return input_ids, attention_mask, loss_mask


def text_batch(tokenizer, prompts: list[str], responses: list[str], max_length: int) -> Batch:
    """encode_examples as a Batch (input_ids, attention_mask, loss_mask): e.g. the
    pre-training rows of a PPO-ptx step, sent to the actor like any batch."""
    input_ids, attention_mask, loss_mask = encode_examples(tokenizer, prompts, responses, max_length)
    return Batch({"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask})


def response_nll(model, input_ids, attention_mask, loss_mask) -> torch.Tensor:
    """Mean cross-entropy over response tokens."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    targets, mask = input_ids[:, 1:], loss_mask[:, 1:].float()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), reduction="none")
    return (nll.view(targets.shape) * mask).sum() / mask.sum()


def train_sft(
    model_dir: str | Path, demonstrations: list[dict], out_dir: str | Path, config: StageConfig = StageConfig()
) -> dict:
    """Fine-tune on rows {"prompt", "response"} or {"messages"} (whole episodes, see the module
    docstring); returns {"path", "losses", "first_loss", "last_loss"}."""
    loaded = load(model_dir)
    model, tokenizer = loaded.model, loaded.tokenizer
    input_ids, attention_mask, loss_mask = encode_demonstrations(tokenizer, demonstrations, config.max_length)

    def batch_loss(rows: list[int]) -> torch.Tensor:
        idx = torch.tensor(rows)
        return response_nll(model, input_ids[idx], attention_mask[idx], loss_mask[idx])

    losses = fit(model, config, len(input_ids), batch_loss, "sft")
    path = save(model, tokenizer, out_dir)
    return {"path": str(path), "losses": losses, "first_loss": losses[0], "last_loss": losses[-1]}
