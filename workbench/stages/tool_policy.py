"""A starting policy for the tool task: the tiny chat kit, briefly fine-tuned on multi-turn
demonstrations (question -> calculator call -> its reply in the tool role -> the answer), cached
on disk — what notebook 07 and bench/agent.py start RL from.

The SFT is deliberately short and its demonstrations mixed: a share of them answer directly
(no calculator), so the SFT policy calls the tool only some of the time and copies digits
imperfectly; RL over episodes then has room to learn that calling pays.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from workbench.data import tool_multiply
from workbench.models import make_tiny
from workbench.models.publish import publish, read_manifest
from workbench.stages.arithmetic_policy import DEFAULT_CACHE
from workbench.stages.sft import StageConfig, train_sft

MANIFEST = "tool_policy.json"


@dataclass(frozen=True)
class ToolPolicyConfig:
    """How the starting policy is made."""

    size: str = "1m"
    """Tiny kit size (the chat kit: make_tiny(size, chat=True))."""
    demonstrations: int = 300
    """Training problems demonstrated (none of the task's reserved held-out problems)."""
    tool_share: float = 0.3
    """Share of demonstrations that call the calculator; the rest answer directly. At 0.3 the
    SFT policy's greedy answer calls it on about half the held-out problems (sampled: one in
    five), so RL has the tool-call rate to raise as well as the digits to get right."""
    steps: int = 600
    """SFT steps (batches of `batch_size` demonstrations). Copying the question's digits into
    the call, and the reply's into the answer, appears between 300 and 600 steps on the 1m kit
    (150 teach the call format alone: every call then holds made-up digits)."""
    batch_size: int = 16
    lr: float = 2e-3
    seed: int = 0


def tool_policy(
    config: ToolPolicyConfig = ToolPolicyConfig(), workdir: str | Path = DEFAULT_CACHE, verbose: bool = True
) -> Path:
    """The SFT'd tool-task policy's directory (cached: a second call with the same settings
    returns it at once; the write is whole or nothing)."""
    workdir = Path(workdir)
    c = config
    directory = workdir / (
        f"tool-multiply-{c.size}-n{c.demonstrations}-t{c.tool_share:g}-sft{c.steps}-lr{c.lr:g}-b{c.batch_size}-s{c.seed}"
    )
    manifest = {"config": asdict(c), "version": 1}
    if read_manifest(directory, MANIFEST) == manifest:
        return directory

    def build(staging: Path) -> None:
        torch.set_num_threads(1)
        base = make_tiny(c.size, workdir / f"tiny-chat-{c.size}-s{c.seed}", seed=c.seed, chat=True)
        train, _ = tool_multiply.split(tool_multiply.MultiplyConfig(), c.demonstrations, 0, seed=c.seed)
        rows = tool_multiply.demonstrations(train, tool_share=c.tool_share, seed=c.seed)
        stage = StageConfig(steps=c.steps, batch_size=c.batch_size, lr=c.lr, max_length=160, seed=c.seed, log_every=0)
        result = train_sft(base, rows, staging, stage)
        if verbose:
            print(
                f"SFT on {len(rows)} tool-task episodes ({c.tool_share:.0%} with the calculator): "
                f"loss {result['first_loss']:.2f} -> {result['last_loss']:.2f} in {c.steps} steps"
            )

    return publish(directory, manifest, MANIFEST, build)
