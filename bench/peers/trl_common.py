"""Shared by the TRL peer scripts (run inside the peer's own virtualenv, not the project's).

Reads the settings JSON the benchmark wrote, times each optimizer step as the wall time between
consecutive `on_step_end` callbacks (so everything the trainer does per step counts, as a user
sees it), and prints one JSON line per run.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from transformers import TrainerCallback


def settings() -> dict:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    return cfg


def arithmetic_module(repo: str):
    """The workbench's arithmetic task module (stdlib only), loaded by path: the same reward."""
    spec = importlib.util.spec_from_file_location("wb_arithmetic", Path(repo) / "workbench" / "data" / "arithmetic.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


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
