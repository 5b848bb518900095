"""DataFuture: the result of a worker-group call, before anyone has fetched it.

Every call returns a DataFuture at once. `.get()` materialises it on the driver. Passed as the
input of another group's call, it becomes one RemoteSlice per destination rank: a small
object holding the source ranks' object refs, which the destination resolves itself, fetching
only the source chunks that overlap its own rows. Tensors then move worker to worker and the
driver never holds the batch.

Each rank returns two objects per call: a tiny OutputMeta (row counts, bytes) and the output.
Destinations read the metas first to know which chunks they need.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import ray
import torch

from workbench.data.batch import PAD_KEY, Batch
from workbench.errors import WorkerCallError, WorkerDiedError

if TYPE_CHECKING:
    from workbench.controller.mesh import Mesh


@dataclass(frozen=True)
class OutputMeta:
    """What a destination needs to know about one rank's output without fetching it."""

    rows: int | None
    """Row count when the output is a Batch, else None."""
    valid: int | None
    """Rows that are not padding (Batch outputs only)."""
    nbytes: int


def describe_output(value: Any) -> OutputMeta:
    if isinstance(value, Batch):
        return OutputMeta(len(value), value.num_valid, value.nbytes)
    if isinstance(value, torch.Tensor):
        return OutputMeta(None, None, value.numel() * value.element_size())
    return OutputMeta(None, None, 0)


@dataclass
class CallInfo:
    """Where a call ran: names used in errors and traces."""

    role: str
    method: str
    ranks: list[int]


class DataFuture:
    """The pending result of one call on a worker group."""

    def __init__(
        self,
        info: CallInfo,
        metas: list[ray.ObjectRef],
        outputs: list[ray.ObjectRef],
        collect_ranks: list[int],
        collect: Callable[[Mesh, list[Any]], Any],
        mesh: Mesh,
    ):
        self.info = info
        self.metas = metas  # one per rank that ran the call, in info.ranks order
        self.outputs = outputs
        self.collect_ranks = collect_ranks
        self.collect = collect
        self.mesh = mesh
        self._value: Any = _UNSET

    def _collected(self) -> tuple[list[ray.ObjectRef], list[ray.ObjectRef]]:
        position = {r: i for i, r in enumerate(self.info.ranks)}
        picks = [position[r] for r in self.collect_ranks]
        return [self.metas[i] for i in picks], [self.outputs[i] for i in picks]

    def done(self) -> bool:
        ready, _ = ray.wait(self.metas, num_returns=len(self.metas), timeout=0, fetch_local=False)
        return len(ready) == len(self.metas)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every rank has finished; raise the first rank's error, if any."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = list(self.metas)
        # Short waits in a loop keep Ctrl-C responsive in a notebook.
        while pending:
            step = 0.2 if deadline is None else max(0.0, min(0.2, deadline - time.monotonic()))
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=step, fetch_local=False)
            if pending and deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.info.role}.{self.info.method} still running after {timeout} s "
                    f"on {len(pending)} of {len(self.metas)} ranks"
                )
        for rank, meta, output in zip(self.info.ranks, self.metas, self.outputs):
            try:
                fetch(meta, self.info, rank)
            except (WorkerCallError, WorkerDiedError):
                _discard(output)  # the output holds the same error; mark it as seen
                raise

    def get(self, timeout: float | None = None) -> Any:
        """The call's result on the driver (collected per the method's protocol)."""
        if self._value is _UNSET:
            self.wait(timeout)
            _, outputs = self._collected()
            values = [fetch(ref, self.info, r) for ref, r in zip(outputs, self.collect_ranks)]
            self._value = self.collect(self.mesh, values)
        return self._value

    def slice(self, index: int, count: int) -> RemoteSlice:
        """Rows index/count of this result, to be fetched by whoever receives the slice."""
        metas, outputs = self._collected()
        return RemoteSlice(self.info, metas, outputs, self.collect_ranks, index, count, self.collect, self.mesh)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"DataFuture({self.info.role}.{self.info.method}, ranks={len(self.metas)}, {state})"


_UNSET = object()


def _discard(ref: ray.ObjectRef) -> None:
    try:
        ray.get(ref, timeout=1)
    except Exception:
        pass


def fetch(ref: ray.ObjectRef, info: CallInfo, rank: int) -> Any:
    """ray.get one rank's object, turning Ray's errors into ones that name role/rank/method."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as err:
        raise WorkerDiedError(info.role, rank, info.method, str(err)) from None
    except ray.exceptions.RayTaskError as err:
        raise WorkerCallError(info.role, rank, info.method, str(err)) from None


@dataclass
class RemoteSlice:
    """Rows [index/count] of another call's collected output, resolved on the receiving rank.

    Rows are counted after dropping the source's padding; if they do not divide by `count`,
    the missing rows are copies of the first rows, marked as padding (as Batch.pad_to_multiple).
    """

    source: CallInfo
    metas: list[ray.ObjectRef]
    outputs: list[ray.ObjectRef]
    ranks: list[int]
    index: int
    count: int
    collect: Callable
    mesh: Mesh

    def resolve(self) -> Any:
        metas = [fetch(m, self.source, r) for m, r in zip(self.metas, self.ranks)]
        if getattr(self.collect, "joins_rows", False) and all(m.rows is not None for m in metas):
            return self._resolve_rows(metas)
        whole = self.collect(self.mesh, [fetch(o, self.source, r) for o, r in zip(self.outputs, self.ranks)])
        if self.count == 1:
            return whole
        if not isinstance(whole, Batch):
            raise TypeError(
                f"the output of {self.source.role}.{self.source.method} is a "
                f"{type(whole).__name__}, which cannot be split across {self.count} ranks; "
                f"return a Batch, or call .get() and pass the value instead"
            )
        return whole.pad_to_multiple(self.count).chunk(self.count)[self.index]

    def _resolve_rows(self, metas: list[OutputMeta]) -> Batch:
        total = sum(m.valid for m in metas)
        if total == 0:
            raise ValueError(f"{self.source.role}.{self.source.method} returned no rows to split")
        per = math.ceil(total / self.count)
        wanted = np.arange(self.index * per, (self.index + 1) * per)
        source_rows = wanted % total  # rows past the end are padding copies of the first rows
        starts = np.cumsum([0] + [m.valid for m in metas])
        needed = sorted({int(np.searchsorted(starts, row, side="right") - 1) for row in source_rows})
        pieces = {i: fetch(self.outputs[i], self.source, self.ranks[i]).unpad() for i in needed}
        local = Batch.concat([pieces[i] for i in needed])
        offsets = {i: int(starts[i]) for i in needed}
        local_start = np.cumsum([0] + [len(pieces[i]) for i in needed])
        position = {i: int(local_start[k]) for k, i in enumerate(needed)}
        picks = []
        for row in source_rows:
            chunk = int(np.searchsorted(starts, row, side="right") - 1)
            picks.append(position[chunk] + int(row) - offsets[chunk])
        out = local[np.asarray(picks)]
        if total % self.count:
            out.tensors[PAD_KEY] = torch.as_tensor(wanted >= total)
        return out
