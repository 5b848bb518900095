"""TRL's GRPOTrainer (trl 1.16) on the benchmark's settings; run by bench/vs_trl.py in its own venv."""

from __future__ import annotations

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from trl_common import StepTimer, arithmetic_module, grpo_arguments, report, settings

cfg = settings()
arithmetic = arithmetic_module(cfg["repo"])
tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
tokenizer.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype="float32")
rows = cfg["prompts"]
dataset = Dataset.from_dict({"prompt": [r["prompt"] for r in rows], "ground_truth": [r["ground_truth"] for r in rows]})


def exact_match(completions, ground_truth, **kwargs):
    return [arithmetic.score(c, t) for c, t in zip(completions, ground_truth)]


class TokenCounter(StepTimer):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "completions/mean_length" in logs:  # tokens up to and including EOS, per row
            self.tokens.append(logs["completions/mean_length"] * cfg["rows"])


timer = TokenCounter()
args = GRPOConfig(
    **grpo_arguments(
        seed=cfg["seed"],
        per_device_train_batch_size=cfg["rows"],
        num_generations=cfg["n"],
        max_completion_length=cfg["new_tokens"],
        temperature=cfg["temperature"],
        learning_rate=cfg["lr"],
        beta=0.0,
        max_steps=cfg["steps"],
    )
)
trainer = GRPOTrainer(
    model=model,
    reward_funcs=exact_match,
    args=args,
    train_dataset=dataset,
    processing_class=tokenizer,
    callbacks=[timer],
)
trainer.train()
report(timer, {"peer": "trl.GRPOTrainer"})
