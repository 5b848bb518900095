"""TRL's PPO trainer (trl.experimental.ppo, trl 1.12.0 — the last release with PPO), stock, on the
benchmark's settings; run by bench/vs_trl.py in its own venv."""

from __future__ import annotations

import tempfile

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
from trl.experimental.ppo import PPOConfig, PPOTrainer
from trl_common import StepTimer, report, settings

cfg = settings()
tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
tokenizer.padding_side = "left"
policy = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype="float32")
ref_policy = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype="float32")
value_model = AutoModelForSequenceClassification.from_pretrained(cfg["reward_model"], num_labels=1, dtype="float32")
reward_model = AutoModelForSequenceClassification.from_pretrained(cfg["reward_model"], num_labels=1, dtype="float32")
ids = [tokenizer(r["prompt"])["input_ids"] for r in cfg["prompts"]]
dataset = Dataset.from_dict({"input_ids": ids})


class TokenCounter(StepTimer):
    """TRL's PPO logs no response lengths: count them at each step from the trainer's last batch."""


timer = TokenCounter()
args = PPOConfig(
    output_dir=tempfile.mkdtemp(),
    use_cpu=True,
    bf16=False,
    fp16=False,
    seed=cfg["seed"],
    per_device_train_batch_size=cfg["rows"],
    gradient_accumulation_steps=1,
    num_mini_batches=1,
    num_ppo_epochs=1,
    local_rollout_forward_batch_size=cfg["rows"],
    response_length=cfg["new_tokens"],
    stop_token="eos",
    temperature=cfg["temperature"],
    learning_rate=cfg["lr"],
    kl_coef=cfg["kl_coef"],
    total_episodes=cfg["rows"] * cfg["steps"],
    num_sample_generations=0,
    logging_steps=1,
    report_to=[],
    save_strategy="no",
    disable_tqdm=True,
    dataloader_num_workers=0,
)
trainer = PPOTrainer(
    args=args,
    processing_class=tokenizer,
    model=policy,
    ref_model=ref_policy,
    reward_model=reward_model,
    value_model=value_model,
    train_dataset=dataset,
    callbacks=[timer],
)

# Generated tokens per step, counted like the workbench (up to and including the first EOS):
# wrap the module-level generation helper the trainer calls once per step.
import trl.experimental.ppo.ppo_trainer as ppo_module  # noqa: E402

original = ppo_module.batch_generation


def counted(model, queries, *rest, **kwargs):
    query_responses, logits = original(model, queries, *rest, **kwargs)
    responses = query_responses[:, queries.shape[1] :]
    is_eos = responses == tokenizer.eos_token_id
    after = (is_eos.cumsum(1) - is_eos.long()) > 0
    timer.tokens.append(float((~after).sum()))
    return query_responses, logits


ppo_module.batch_generation = counted
trainer.train()
report(timer, {"peer": "trl.experimental.ppo.PPOTrainer"})
