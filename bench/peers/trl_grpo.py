"""TRL's GRPOTrainer (trl 1.16) on the benchmark's settings; run by bench/vs_trl.py in its own venv."""

from __future__ import annotations

import tempfile

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from trl_common import StepTimer, arithmetic_module, report, settings

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
    output_dir=tempfile.mkdtemp(),
    use_cpu=True,
    bf16=False,
    fp16=False,
    seed=cfg["seed"],
    per_device_train_batch_size=cfg["rows"],
    num_generations=cfg["n"],
    gradient_accumulation_steps=1,
    steps_per_generation=1,
    num_iterations=1,
    max_completion_length=cfg["new_tokens"],
    temperature=cfg["temperature"],
    top_p=1.0,
    learning_rate=cfg["lr"],
    beta=0.0,
    max_steps=cfg["steps"],
    logging_steps=1,
    report_to=[],
    save_strategy="no",
    disable_tqdm=True,
    dataloader_num_workers=0,
    log_completions=False,
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
