"""Errors that name where things went wrong (role, rank, method) and what to do about it."""

from __future__ import annotations


class WorkbenchError(Exception):
    """Base of the workbench's own errors."""


class ConfigError(WorkbenchError, ValueError):
    """A setting is refused on the driver, before any remote work: names field, value and fix."""

    def __init__(self, where: str, value, fix: str):
        self.where, self.value, self.fix = where, value, fix
        super().__init__(f"{where}={value!r}: {fix}")


class WorkerCallError(WorkbenchError):
    """A registered method raised inside a worker; carries the remote traceback.

    usable: False when the failure was in the group's start-up (then no group exists).
    busy: other ranks that did not answer afterwards (e.g. still waiting in a collective for
    the failed rank), so the message does not promise a usable group it cannot vouch for."""

    def __init__(
        self,
        role: str,
        rank: int,
        method: str,
        remote_traceback: str,
        usable: bool = True,
        busy: list[int] | tuple = (),
    ):
        self.role, self.rank, self.method, self.usable, self.busy = role, rank, method, usable, list(busy)
        self.remote_traceback = remote_traceback
        if not usable:
            remedy = (
                f"The group {role!r} was not created (its processes were stopped); fix the cause "
                f"and re-run the cell that creates it."
            )
        elif busy:
            remedy = (
                f"Rank(s) {list(busy)} still have not finished (they may be waiting in a collective "
                f"for rank {rank}); if they do not, call session.recover({role!r}) to restart the group."
            )
        else:
            remedy = "Every rank of the group answers, so it is still usable; fix the cause and call again."
        super().__init__(
            f"{role}.{method} failed on rank {rank}. {remedy}"
            f"\n--- remote traceback (rank {rank}) ---\n{remote_traceback}"
        )


class WorkerDiedError(WorkbenchError):
    """A worker process is gone (killed, out of memory, crashed); its group is unusable."""

    def __init__(
        self,
        role: str,
        rank: int,
        method: str,
        detail: str = "",
        pid: int | None = None,
        node: str | None = None,
        fused: list[str] | tuple = (),
        fix: str = "",
    ):
        self.role, self.rank, self.method, self.pid, self.node = role, rank, method, pid, node
        where = f" (pid {pid} on node {node})" if pid is not None else ""
        others = [r for r in fused if r != role]
        also = f" and the role(s) {others} fused with it in the same processes" if others else ""
        fix = fix or (
            f"The group {role!r}{also} cannot be used any more: call session.recover({role!r}) to "
            f"start it again on its pool with the same config, or re-run its session.group(...) cell"
        )
        super().__init__(
            f"worker rank {rank} of role {role!r}{where} died during {role}.{method} (process killed, "
            f"out of memory or crashed). {fix}. Other groups are unaffected."
            + (f"\n--- Ray said ---\n{detail}" if detail else "")
        )


class GroupRemovedError(WorkbenchError):
    """A handle to a worker group whose processes were removed and not replaced."""

    def __init__(self, role: str, reason: str):
        self.role, self.reason = role, reason
        super().__init__(
            f"the worker group {role!r} no longer exists: {reason}. Re-run the cell that creates "
            f"it (session.group({role!r}, ...) or session.fused(...)); handles then follow the new group."
        )


class NonFiniteError(WorkbenchError):
    """NaN or inf in an iteration's data, found on the driver before the update that would use
    it: no weight has changed. Names the field, the step that made it (workbench.steps) and the rows."""

    def __init__(self, field: str, step: str, uids: list, before: str):
        self.field, self.step, self.uids = field, step, uids
        shown = ", ".join(map(str, uids[:8])) + (f" and {len(uids) - 8} more" if len(uids) > 8 else "")
        super().__init__(
            f"NaN/inf in {field!r} (made by the {step!r} step) in {len(uids)} row(s), uid {shown}; "
            f"{before} was not run, so no weight changed. Look at those rows' inputs to {step!r} "
            f"(e.g. a reward function returning nan, or a loss scale that overflowed)"
        )


class SessionClosedError(WorkbenchError):
    """The Session was shut down; start a new one."""


class PlacementError(WorkbenchError):
    """A resource pool cannot be placed on the cluster."""


class DispatchError(WorkbenchError):
    """A call's inputs do not fit the group's layout; raised on the driver before any remote work."""


class WeightSyncError(WorkbenchError):
    """The actor's generation weights are not its training weights after a layout switch: the
    rollout would sample from stale or misplaced weights."""

    def __init__(self, tensor: str, rank: int, train_checksum: float, gen_checksum: float):
        self.tensor, self.rank = tensor, rank
        self._args = (tensor, rank, train_checksum, gen_checksum)
        super().__init__(
            f"weight sync check failed on rank {rank}: {tensor!r} sums to {gen_checksum!r} over the generation "
            f"pieces but {train_checksum!r} over the training pieces. The generation weights are stale or "
            f"misplaced; report the Mesh (tp, gen_tp, transition) this ran with"
        )

    def __reduce__(self):  # travels from a worker back to the driver intact
        return type(self), self._args
