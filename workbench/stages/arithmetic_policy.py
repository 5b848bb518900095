"""A starting policy for the arithmetic task: a tiny model, briefly fine-tuned (SFT) on
demonstrations, cached on disk — what the demo, the notebooks and the benchmarks start RL from."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from workbench.data import arithmetic
from workbench.models import make_tiny
from workbench.stages.sft import StageConfig, train_sft

DEFAULT_CACHE = Path.home() / ".cache" / "hybridflow-workbench"


def arithmetic_policy(
    workdir: str | Path = DEFAULT_CACHE,
    size: str = "1m",
    sft_steps: int = 200,
    digits: int = 1,
    seed: int = 0,
    verbose: bool = True,
) -> Path:
    """The `size` tiny model after `sft_steps` SFT steps on `digits`-digit additions (cached:
    a second call with the same settings returns the saved directory at once)."""
    workdir = Path(workdir)
    sft_dir = workdir / f"arithmetic-{size}-d{digits}-sft{sft_steps}-s{seed}"
    if not (sft_dir / "config.json").exists():
        torch.set_num_threads(1)
        base = make_tiny(size, workdir / f"tiny-{size}-s{seed}", seed=seed)
        problems = arithmetic.generate(arithmetic.ArithmeticConfig(digits=digits), 400, seed=seed)
        staging = Path(tempfile.mkdtemp(prefix=f".{sft_dir.name}.", dir=workdir))
        result = train_sft(
            base, arithmetic.demonstrations(problems), staging, StageConfig(steps=sft_steps, log_every=0)
        )
        staging.chmod(0o755)
        if (sft_dir / "config.json").exists():  # another process finished first
            shutil.rmtree(staging)
        else:
            shutil.rmtree(sft_dir, ignore_errors=True)
            staging.rename(sft_dir)  # whole or nothing: an interrupted run leaves no half model
        if verbose:
            print(f"SFT {size}: loss {result['first_loss']:.2f} -> {result['last_loss']:.2f} in {sft_steps} steps")
    return sft_dir
