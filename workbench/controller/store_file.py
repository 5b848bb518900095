"""The file of a torch FileStore, the rendezvous of ranks on one machine (a worker set's process
group, a weight channel): private to its owner, and deleted by torch when its last member is
done, so nothing is left behind where no member removes it by hand."""

from __future__ import annotations

import contextlib
import os
import tempfile


def new_store_file(prefix: str) -> str:
    """A fresh empty file in the temp dir that only its owner can read or write (0600)."""
    handle, path = tempfile.mkstemp(prefix=prefix)
    os.close(handle)
    return path


def remove_store_file(path: str) -> None:
    """Remove it where torch could not (a member was killed, or the owner is done first)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
