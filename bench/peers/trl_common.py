"""Shared by the TRL peer scripts (run inside the peer's own virtualenv, not the project's).

Reads the settings JSON the benchmark wrote, times each optimizer step as the wall time between
consecutive `on_step_end` callbacks (so everything the trainer does per step counts, as a user
sees it), and prints one JSON line per run.
"""

from __future__ import annotations

import importlib
import json
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
from transformers import TrainerCallback


def grpo_arguments(**settings) -> dict:
    """GRPOConfig's arguments that both GRPO peers share (CPU, fp32, one optimizer step per
    generation, a log line per step, nothing saved), with each peer's own `settings`."""
    shared = dict(
        output_dir=tempfile.mkdtemp(),
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        top_p=1.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )
    return shared | settings


def settings() -> dict:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    return cfg


def task_module(repo: str, name: str):
    """A stdlib-only module of the workbench (e.g. "workbench.data.arithmetic_chat"), imported
    from the repository without running the packages' __init__s (they pull in Ray and torch
    workers): the same task code, hence the same reward, in the peer's environment."""
    parts = name.split(".")
    for i in range(1, len(parts)):  # bare package objects: submodule imports resolve through __path__
        package = ".".join(parts[:i])
        if package not in sys.modules:
            module = types.ModuleType(package)
            module.__path__ = [str(Path(repo, *parts[:i]))]
            sys.modules[package] = module
    return importlib.import_module(name)


def arithmetic_module(repo: str):
    """The workbench's arithmetic task module: the same reward as the workbench's runs."""
    return task_module(repo, "workbench.data.arithmetic")


class StepTimer(TrainerCallback):
    """Seconds between consecutive step ends, and generated tokens per step (from the logs)."""

    def __init__(self):
        self.last = None
        self.seconds: list[float] = []
        self.tokens: list[float] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.seconds.append(now - self.last)
        self.last = now


def report(timer: StepTimer, extra: dict) -> None:
    print(json.dumps({"seconds": timer.seconds, "tokens": timer.tokens, **extra}))
