"""What several test modules share: the smallest model that still exercises the compiler, and a
reward no two different texts tie on."""

from __future__ import annotations

import zlib
from dataclasses import replace
from pathlib import Path

from workbench.models import SIZES, make_tiny

# The 1m shape with one decoder block: torch.compile traces and lowers every block, so compiled
# paths (dynamo guards, inductor kernels, recompiles) are exercised whole at about a third of
# the 4-block model's compile time.
ONE_BLOCK = replace(SIZES["1m"], num_layers=1)


def make_one_block(directory: Path, seed: int = 0) -> str:
    """A random-init one-block tiny Llama (the default tokenizer, as the 1m kit)."""
    return str(make_tiny(ONE_BLOCK, directory, seed=seed))


def checksum_score(text: str) -> float:
    """A score in [0, 1) that differs between any two different texts (a checksum of the text),
    so every group's samples score apart on any machine: advantages are never all 0 and every
    update moves the weights. (A reward an untrained model's samples may tie on, such as exact
    match or a digit count, gave some iterations no update at all on another CPU.)"""
    return zlib.crc32(text.encode()) / 2**32
