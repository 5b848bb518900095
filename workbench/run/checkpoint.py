"""Whole-run checkpoints, coordinated by the single controller.

    ckpt = RunCheckpointer("runs/ppo/checkpoints", keep=3)
    ckpt.save(ppo, extra={"batches": 12})     # after an iteration
    state = ckpt.restore(ppo)                 # the newest complete one: {"iteration", "extra", "path"}
    taken = ppo.snapshot(); ...; ppo.restore(taken)   # the same in memory (algorithms.snapshot)

A checkpoint is one directory, `step-000012/`:
- `<role>/` for each trained group (actor, critic, cost_critic): the group's own
  `save_checkpoint` — weights and optimizer state sharded per rank (FSDP through
  torch.distributed.checkpoint, DeepSpeed through its engine), and each rank's random generators
  and counters;
- `run.pt`: the algorithm's `state_dict()` (iteration, metrics so far, KL controller, Lagrange
  multiplier), the driver's random generators and `extra` (the caller's: e.g. how many prompt
  batches were consumed, which is the loader's position for `PromptLoader.batches(start)`).

Writes are atomic: a step is written under `.partial-step-000012/`, then renamed, and only then is
`latest` (a one-line file naming the newest step) replaced, with `os.replace`. A crash at any point
leaves the previous step and `latest` as they were; leftovers are removed by the next save. The
newest `keep` steps are kept. The directory must be one every rank can write and the driver can
rename in (a shared filesystem on a multi-node cluster).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from algorithms.snapshot import trained_groups
from workbench import checks
from workbench.errors import ConfigError
from workbench.workers.updates import rng_state, set_rng_state

STEP_PREFIX, PARTIAL_PREFIX = "step-", ".partial-"


class RunCheckpointer:
    """Saves and restores whole runs under `directory`, keeping the newest `keep` steps."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3):
        checks.whole("RunCheckpointer", "keep", keep, fix="keep at least 1 checkpoint")
        self.directory, self.keep = Path(directory), keep

    # ---- where things are --------------------------------------------------------------------
    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None before the first save."""
        pointer = self.directory / "latest"
        if not pointer.exists():
            return None
        path = self.directory / pointer.read_text().strip()
        return path if (path / "run.pt").exists() else None

    def steps(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.directory.exists():
            return []
        return sorted(p for p in self.directory.glob(f"{STEP_PREFIX}*") if (p / "run.pt").exists())

    # ---- save and restore --------------------------------------------------------------------
    def save(self, algorithm, iteration: int | None = None, extra: dict[str, Any] | None = None) -> Path:
        """Checkpoint every trained group and the driver's state after `iteration` (default: the
        algorithm's count of finished iterations). Returns the step's directory."""
        iteration = algorithm.iteration if iteration is None else iteration
        groups = trained_groups(algorithm)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(f"{PARTIAL_PREFIX}*"):  # a crash's leftovers
            shutil.rmtree(stale, ignore_errors=True)
        name = f"{STEP_PREFIX}{iteration:06d}"
        partial = self.directory / f"{PARTIAL_PREFIX}{name}"
        partial.mkdir()
        before = {role: group.hostset.checkpoints.get(role) for role, group in groups.items()}
        try:
            futures = [group.save_checkpoint(str(partial / role)) for role, group in groups.items()]
            for future in futures:  # every group writes at once
                future.get()
            torch.save(
                {
                    "iteration": iteration,
                    "algorithm_class": type(algorithm).__name__,
                    "roles": sorted(groups),
                    "algorithm": algorithm.state_dict(),
                    "rng": rng_state(),
                    "extra": dict(extra or {}),
                },
                partial / "run.pt",
            )
        except BaseException:  # session.recover must not reload a half-written step
            for role, group in groups.items():
                if before[role] is None:
                    group.hostset.checkpoints.pop(role, None)
                else:
                    group.hostset.checkpoints[role] = before[role]
            raise
        final = self.directory / name
        if final.exists():  # the same iteration saved again (e.g. redone after a recovery)
            old = self.directory / f"{PARTIAL_PREFIX}old-{name}"
            final.rename(old)
            partial.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            partial.rename(final)
        for role, group in groups.items():  # session.recover(role) reloads from the final path
            group.hostset.checkpoints[role] = str(final / role)
        pointer = self.directory / ".latest.tmp"
        pointer.write_text(name + "\n")
        os.replace(pointer, self.directory / "latest")
        for old in self.steps()[: -self.keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def restore(self, algorithm, path: str | os.PathLike | None = None) -> dict[str, Any]:
        """Load a checkpoint (default: the newest) into every trained group and the algorithm,
        and set the driver's random generators. Returns {"iteration", "extra", "path"}."""
        path = Path(path) if path is not None else self.latest()
        if path is None:
            raise ConfigError(
                "RunCheckpointer.restore",
                str(self.directory),
                "no complete checkpoint there yet; save one first or pass path=",
            )
        if not (path / "run.pt").exists():
            raise ConfigError(
                "RunCheckpointer.restore path",
                str(path),
                "not a complete checkpoint (no run.pt): pass a step-XXXXXX directory",
            )
        state = torch.load(path / "run.pt", weights_only=False)
        groups = trained_groups(algorithm)
        if state["algorithm_class"] != type(algorithm).__name__ or state["roles"] != sorted(groups):
            raise ConfigError(
                "RunCheckpointer.restore",
                str(path),
                f"it holds a {state['algorithm_class']} run with trained roles {state['roles']}; this is a "
                f"{type(algorithm).__name__} with {sorted(groups)}: restore it into the same algorithm and roles",
            )
        futures = [group.load_checkpoint(str(path / role)) for role, group in groups.items()]
        for future in futures:
            future.get()
        algorithm.load_state_dict(state["algorithm"])
        set_rng_state(state["rng"])
        return {"iteration": state["iteration"], "extra": state["extra"], "path": path}

    def export_hf(self, algorithm, directory: str | os.PathLike) -> dict[str, Path]:
        """The trained models' current weights as plain Hugging Face directories (actor: a causal
        LM with its tokenizer; critics: token-classification value models), one per role."""
        out = {}
        for role, group in trained_groups(algorithm).items():
            out[role] = Path(directory) / role
            group.export_hf(str(out[role])).get()
        return out
