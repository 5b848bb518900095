"""Errors that name where things went wrong (role, rank, method) and what to do about it."""

from __future__ import annotations


class WorkbenchError(Exception):
    """Base of the workbench's own errors."""


class WorkerCallError(WorkbenchError):
    """A registered method raised inside a worker; carries the remote traceback."""

    def __init__(self, role: str, rank: int, method: str, remote_traceback: str):
        self.role, self.rank, self.method = role, rank, method
        self.remote_traceback = remote_traceback
        super().__init__(
            f"{role}.{method} failed on rank {rank}. The group is still usable; fix the cause "
            f"and call again.\n--- remote traceback (rank {rank}) ---\n{remote_traceback}"
        )


class WorkerDiedError(WorkbenchError):
    """A worker process is gone (killed, out of memory, crashed)."""

    def __init__(self, role: str, rank: int, method: str, detail: str = ""):
        self.role, self.rank, self.method = role, rank, method
        super().__init__(
            f"worker rank {rank} of role {role!r} died during {role}.{method} (process killed, "
            f"out of memory or crashed). Recreate the group by re-running its "
            f"session.group(...) cell; other groups are unaffected."
            + (f"\n--- Ray said ---\n{detail}" if detail else "")
        )


class PlacementError(WorkbenchError):
    """A resource pool cannot be placed on the cluster."""


class DispatchError(WorkbenchError):
    """A call's inputs do not fit the group's layout; raised on the driver before any remote work."""
