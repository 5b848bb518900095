"""Model directories written whole or not at all, shared by the tiny kit and GGUF imports.

A directory is built in a private sibling, stamped with a manifest of what it holds and renamed
into place, so processes that race to make the same model never see a half-written one: the
second to finish finds the first's identical manifest and keeps it."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def read_manifest(directory: Path, name: str) -> dict | None:
    """The manifest `name` of `directory`, or None where there is none (or it is unreadable)."""
    try:
        return json.loads((directory / name).read_text())
    except (OSError, ValueError):
        return None


def publish(directory: Path, manifest: dict, name: str, build: Callable[[Path], None]) -> Path:
    """`build` the directory's content into a staging sibling, then put it in place with its
    manifest `name`. Whatever stands at `directory` with another manifest is replaced: callers
    refuse beforehand what must not be."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; a checkpoint is ordinary readable data
    try:
        build(staging)
        (staging / name).write_text(json.dumps(manifest, indent=2) + "\n")
        if directory.exists():
            if read_manifest(directory, name) == manifest:  # another process finished first
                return directory
            shutil.rmtree(directory)
        try:
            os.replace(staging, directory)
        except OSError:
            if read_manifest(directory, name) != manifest:  # lost a race to something else
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory
