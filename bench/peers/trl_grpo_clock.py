"""TRL's GRPOTrainer (trl 1.16) trained against a wall clock, with held-out greedy evaluations
at fixed points of training time; run by bench/real_model.py in its own venv.

The clock runs from the start of training (`on_train_begin`) and stops during evaluations; an
evaluation happens at the first step end at or after each point, and training stops after the
last. Per-step seconds are split by wrapping the trainer's own methods (a profile: TRL's
profiling spans go only to wandb/mlflow/trackio): generation (`_generate`), log-probs (forwards
of `_get_per_token_logps_and_entropies` under no_grad, i.e. outside the loss), the reward, and
the update (the rest of the step: the loss's forward, backward, optimizer step).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl_common import grpo_arguments, settings, task_module

cfg = settings()
chat = task_module(cfg["repo"], "workbench.data.arithmetic_chat")
tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
tokenizer.padding_side = "left"
if tokenizer.pad_token is None:  # as the workbench loads it (LoadConfig.pad_token="eos")
    tokenizer.pad_token = tokenizer.eos_token
model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype="float32")
train = cfg["train"]
dataset = Dataset.from_dict(
    {"prompt": [r["prompt"] for r in train], "ground_truth": [r["ground_truth"] for r in train]}
)


def final_number_match(completions, ground_truth, **kwargs):
    """arithmetic_chat.score on the assistant's text (TRL gives chat completions as messages)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [chat.score(t, truth) for t, truth in zip(texts, ground_truth)]


def log(message: str) -> None:
    print(f"[trl] {message}", file=sys.stderr, flush=True)


@torch.no_grad()
def held_out_accuracy(model) -> float:
    """Greedy answers to every held-out prompt in one left-padded batch, graded by the task."""
    rows = cfg["held_out"]
    inputs = tokenizer.apply_chat_template(
        [r["prompt"] for r in rows],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        padding=True,
        return_tensors="pt",
    )
    was_training = model.training
    model.eval()
    out = model.generate(**inputs, do_sample=False, max_new_tokens=cfg["tokens"], pad_token_id=tokenizer.pad_token_id)
    model.train(was_training)
    texts = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(chat.score(t, r["ground_truth"]) for t, r in zip(texts, rows)) / len(rows)


class Clock(TrainerCallback):
    """Training seconds (evaluations excluded); evaluates at the points, stops after the last."""

    def __init__(self):
        self.clock, self.resumed = 0.0, None
        self.curve: list[dict] = []
        self.step_seconds: list[float] = []

    def evaluate(self, model, step: int) -> None:
        start = time.perf_counter()
        acc = held_out_accuracy(model)
        self.curve.append({"seconds": round(self.clock, 2), "acc": acc, "iteration": step})
        spent = time.perf_counter() - start
        log(f"step {step:4d}  training {self.clock:7.1f} s  held-out acc {acc:.3f}  (eval {spent:.1f} s)")
        self.resumed = time.perf_counter()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.evaluate(model, 0)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        now = time.perf_counter()
        self.step_seconds.append(now - self.resumed)
        self.clock += now - self.resumed
        self.resumed = now
        if self.clock >= cfg["points"][len(self.curve)]:
            self.evaluate(model, state.global_step)
        if len(self.curve) >= len(cfg["points"]):
            control.should_training_stop = True


class Profile:
    """Seconds per step in the trainer's methods, by part (wrapping the instance's methods)."""

    def __init__(self, trainer):
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self.current: dict[str, float] = defaultdict(float)
        self.first_prompt_ids = None
        self.wrap(trainer, "_generate", "generate")
        self.wrap(trainer, "_calculate_rewards", "reward")
        self.wrap(trainer, "_prepare_inputs", "prepare")
        self.wrap(trainer, "_get_per_token_logps_and_entropies", "log_probs", only_no_grad=True)
        tokenize = trainer._tokenize_prompts

        def remember_first(prompts):  # the ids TRL itself rendered: the caller checks they are the workbench's
            out = tokenize(prompts)
            if self.first_prompt_ids is None:
                self.first_prompt_ids = list(map(int, out[0][0]))
            return out

        trainer._tokenize_prompts = remember_first

    def wrap(self, trainer, method: str, part: str, only_no_grad: bool = False) -> None:
        inner = getattr(trainer, method)

        def timed(*args, **kwargs):
            if only_no_grad and torch.is_grad_enabled():
                return inner(*args, **kwargs)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - start

        setattr(trainer, method, timed)

    def end_step(self) -> None:
        for part in ("generate", "reward", "prepare", "log_probs"):
            self.seconds[part].append(self.current.pop(part, 0.0))


timer = Clock()
args = GRPOConfig(
    **grpo_arguments(
        seed=cfg["seed"],
        per_device_train_batch_size=cfg["prompts"] * cfg["n"],
        num_generations=cfg["n"],
        shuffle_dataset=False,  # the bench gives both sides the same prompts in the same order
        max_completion_length=cfg["tokens"],
        temperature=cfg["temperature"],
        learning_rate=cfg["lr"],
        lr_scheduler_type="constant",  # the workbench's optimizer has no schedule
        warmup_steps=0,
        weight_decay=cfg["weight_decay"],
        max_grad_norm=cfg["grad_clip"],
        gradient_checkpointing=cfg[
            "gradient_checkpointing"
        ],  # TRL 1.16 defaults to True; the workbench's config to False
        beta=cfg["kl"],
        max_steps=10**6,  # the clock stops training
    )
)
peft_config = None
if cfg["lora"]:
    from peft import LoraConfig

    lora = cfg["lora"]
    peft_config = LoraConfig(
        r=lora["rank"],
        lora_alpha=lora["alpha"],
        lora_dropout=0.0,
        target_modules=list(lora["target_modules"]),
        task_type="CAUSAL_LM",
    )
trainer = GRPOTrainer(
    model=model,
    reward_funcs=final_number_match,
    args=args,
    train_dataset=dataset,
    processing_class=tokenizer,
    callbacks=[timer],
    peft_config=peft_config,
)
profile = Profile(trainer)


class EndStep(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        profile.end_step()


trainer.add_callback(EndStep())
trainer.train()


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3) if values else 0.0


n = min(len(timer.step_seconds), len(profile.seconds["prepare"]))
first = 1 if n > 1 else 0  # the first step warms up; medians over the rest
parts = {k: v[first:n] for k, v in profile.seconds.items()}
steps = timer.step_seconds[first:n]
update = [s - p for s, p in zip(steps, parts["prepare"])]
other = [
    p - g - r - lp for p, g, r, lp in zip(parts["prepare"], parts["generate"], parts["reward"], parts["log_probs"])
]
result = {
    "peer": "trl.GRPOTrainer",
    "curve": timer.curve,
    "steps": len(timer.step_seconds),
    "first_step_s": round(timer.step_seconds[0], 3) if timer.step_seconds else None,
    "step_s": median(steps),
    "parts_s": {
        "generate": median(parts["generate"]),
        "log_probs": median(parts["log_probs"]),
        "reward": median(parts["reward"]),
        "other_prepare": median(other),
        "update": median(update),
    },
    "first_prompt_ids": profile.first_prompt_ids,
    "loss_type": args.loss_type,
    "scale_rewards": args.scale_rewards,
    "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
}
print(json.dumps(result))
