"""Supervised fine-tuning: next-token cross-entropy on the response tokens of demonstrations.

Single process, on whatever device the model is on: the tiny sizes train in seconds to
minutes on a CPU. The result is saved as a normal Hugging Face checkpoint directory.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from workbench.data.batch import Batch
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


def __getattr__(name: str):
    if name == "SFTConfig":  # one config for every stage
        warnings.warn("SFTConfig is now StageConfig", DeprecationWarning, stacklevel=2)
        return StageConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
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
    """Fine-tune on rows {"prompt", "response"}; returns {"path", "losses", "first_loss", "last_loss"}."""
    loaded = load(model_dir)
    model, tokenizer = loaded.model, loaded.tokenizer
    input_ids, attention_mask, loss_mask = encode_examples(
        tokenizer, [d["prompt"] for d in demonstrations], [d["response"] for d in demonstrations], config.max_length
    )

    def batch_loss(rows: list[int]) -> torch.Tensor:
        idx = torch.tensor(rows)
        return response_nll(model, input_ids[idx], attention_mask[idx], loss_mask[idx])

    losses = fit(model, config, len(input_ids), batch_loss, "sft")
    path = save(model, tokenizer, out_dir)
    return {"path": str(path), "losses": losses, "first_loss": losses[0], "last_loss": losses[-1]}
