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
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np
import ray
import torch

from workbench.data.batch import PAD_KEY, Batch
from workbench.errors import WorkerCallError, WorkerDiedError

if TYPE_CHECKING:
    from workbench.mesh import Mesh

T = TypeVar("T")


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
    hostset: Any = None
    """The HostSet that ran it: asked which rank died when a call fails."""
    starting: bool = False
    """A step of the group's start-up: on failure no group exists."""

    def __getstate__(self) -> dict:
        # The HostSet stays on the driver: pickled into every RemoteSlice it would ship the
        # group's pool, its pending object refs and its span tags to each receiving worker,
        # which then borrowed those refs and held them, call after call (bench/soak.py).
        return {**self.__dict__, "hostset": None}


class DataFuture(Generic[T]):
    """The pending result of one call on a worker group; `.get()` gives a T (typed handles,
    workbench.workers.handles, say which)."""

    trace_tags: dict
    """The call's trace tags, set by whoever made the call (the step clock adds to them)."""

    def __init__(
        self,
        info: CallInfo,
        outputs: list[ray.ObjectRef],
        metas: list[ray.ObjectRef] | None,
        collect_ranks: list[int],
        collect: Callable[[Mesh, list[Any]], Any],
        mesh: Mesh,
    ):
        self.info = info
        self.outputs = outputs  # one per rank that ran the call, in info.ranks order
        self.metas = metas  # likewise, for calls whose outputs may be split by rows; else None
        self.collect_ranks = collect_ranks
        self.collect = collect
        self.mesh = mesh
        self._value: Any = _UNSET

    def _picks(self) -> list[int]:
        position = {r: i for i, r in enumerate(self.info.ranks)}
        return [position[r] for r in self.collect_ranks]

    def done(self) -> bool:
        refs = self.metas or self.outputs
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        return len(ready) == len(refs)

    def wait(self, timeout: float | None = None) -> None:
        """Block until every rank has finished; raise the first failing rank's error."""
        self._fetch(self.metas or self.outputs, self.info.ranks, timeout)

    def get(self, timeout: float | None = None) -> T:
        """The call's result on the driver (collected per the method's protocol)."""
        if self._value is _UNSET:
            picks = self._picks()
            if self.metas is None:  # small outputs: fetch every rank's (errors show up too)
                fetched = self._fetch(self.outputs, self.info.ranks, timeout)
                values = [fetched[i] for i in picks]
            else:  # every rank's meta (to see errors on ranks not collected) + collected outputs
                refs = self.metas + [self.outputs[i] for i in picks]
                values = self._fetch(refs, self.info.ranks + self.collect_ranks, timeout)[len(self.metas) :]
            self._value = self.collect(self.mesh, values)
        return self._value

    def _fetch(self, refs: list[ray.ObjectRef], ranks: list[int], timeout: float | None) -> list[Any]:
        try:
            return ray.get(refs, timeout=timeout)  # interruptible: Ctrl-C leaves the call running
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"{self.info.role}.{self.info.method} still running after {timeout} s") from None
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
            for output in self.outputs:
                _discard(output)  # outputs hold the same errors; mark them as seen
            fetch_all(refs, self.info, ranks)  # raises the error naming the failing rank
            raise

    def slice(self, index: int, count: int) -> RemoteSlice:
        """Rows index/count of this result, to be fetched by whoever receives the slice."""
        picks = self._picks()
        return RemoteSlice(
            self.info,
            [self.outputs[i] for i in picks],
            None if self.metas is None else [self.metas[i] for i in picks],
            self.collect_ranks,
            index,
            count,
            self.collect,
            self.mesh,
        )

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"DataFuture({self.info.role}.{self.info.method}, ranks={len(self.outputs)}, {state})"


_UNSET = object()


def _discard(ref: ray.ObjectRef) -> None:
    try:
        ray.get(ref, timeout=1)
    except Exception:
        pass


SCORER_FIX = (
    "Its scoring process is gone: workbench.workers.rule_reward.restart_dead_scorers() starts "
    "another (the headless runner does it when it recovers)"
)


def fetch(ref: ray.ObjectRef, info: CallInfo, rank: int) -> Any:
    """ray.get one rank's object, turning Ray's errors into ones that name role/rank/method."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as err:
        if info.starting:  # a process that failed to start: no group to recover
            raise WorkerCallError(info.role, rank, info.method, str(err), usable=False) from None
        if info.hostset is not None:
            info.hostset.dead = info.hostset.dead or (rank, str(err))
            raise info.hostset.died_error(info.role, info.method) from None
        fix = SCORER_FIX if info.role == "rule_reward" else ""
        raise WorkerDiedError(info.role, rank, info.method, str(err), fix=fix) from None
    except ray.exceptions.RayTaskError as err:
        raise _call_error(info, rank, str(err)) from None


def _call_error(info: CallInfo, rank: int, detail: str) -> Exception:
    """A rank raised: blame a dead peer if there is one (a survivor's collective fails with
    'connection closed' when its peer is killed), else report the rank's own exception and
    whether the others still answer."""
    if info.starting:
        return WorkerCallError(info.role, rank, info.method, detail, usable=False)
    if info.hostset is None:
        return WorkerCallError(info.role, rank, info.method, detail)
    if info.hostset.find_dead() is not None:
        return info.hostset.died_error(info.role, info.method)
    busy = [r for r in info.hostset.busy_ranks() if r != rank]
    return WorkerCallError(info.role, rank, info.method, detail, busy=busy)


def fetch_all(refs: list[ray.ObjectRef], info: CallInfo, ranks: list[int], timeout: float | None = None) -> list[Any]:
    """ray.get several ranks' objects in one round trip; on failure, name the failing rank
    (a dead process first: the other ranks' errors are its consequences). With `timeout` (a
    group's start): ranks that have not answered by then are named, as not started."""
    if timeout is not None:
        ready, late = ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=False)
        if late:
            silent = [ranks[i] for i, ref in enumerate(refs) if ref in late]
            for i, ref in enumerate(refs):  # an error among those that answered says more
                if ref in ready:
                    fetch(ref, info, ranks[i])
            raise WorkerCallError(
                info.role,
                silent[0],
                info.method,
                f"rank(s) {silent} did not answer within {timeout:.0f} s (a process Ray could not start or "
                "place, or one waiting for a peer that never came); the Ray state of the processes: "
                "`ray list actors --filter state!=ALIVE`",
                usable=not info.starting,
            )
    try:
        return ray.get(refs)
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
        if not info.starting and info.hostset is not None and info.hostset.find_dead() is not None:
            raise info.hostset.died_error(info.role, info.method) from None
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
        order = sorted(range(len(refs)), key=lambda i: refs[i] not in ready)  # finished ones first
        for i in order:
            fetch(refs[i], info, ranks[i])
        raise


@dataclass
class RemoteSlice:
    """Rows [index/count] of another call's collected output, resolved on the receiving rank.

    Rows are counted after dropping the source's padding; if they do not divide by `count`,
    the missing rows are copies of the first rows, marked as padding (as Batch.pad_to_multiple).
    The source's metas are handed to the receiving task as top-level arguments, so Ray ships
    their (tiny) values with the task and `meta_values` is filled in before `resolve()`.
    """

    source: CallInfo
    outputs: list[ray.ObjectRef]
    metas: list[ray.ObjectRef] | None
    ranks: list[int]
    index: int
    count: int
    collect: Callable
    mesh: Mesh
    meta_values: list[OutputMeta] | None = None

    def resolve(self) -> Any:
        metas = self.meta_values
        if metas is None and self.metas is not None:
            metas = fetch_all(self.metas, self.source, self.ranks)
        if metas is not None and getattr(self.collect, "joins_rows", False) and all(m.rows is not None for m in metas):
            return self._resolve_rows(metas)
        whole = self.collect(self.mesh, fetch_all(self.outputs, self.source, self.ranks))
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
        total = sum(m.valid or 0 for m in metas)
        if total == 0:
            raise ValueError(f"{self.source.role}.{self.source.method} returned no rows to split")
        per = math.ceil(total / self.count)
        wanted = np.arange(self.index * per, (self.index + 1) * per)
        rows = wanted % total  # rows past the end are padding copies of the first rows
        starts = np.cumsum([0] + [m.valid or 0 for m in metas])
        chunk_of_row = np.searchsorted(starts, rows, side="right") - 1
        # Runs of consecutive rows inside one source chunk: each becomes a slice (a view).
        runs: list[list[int]] = []  # [chunk, first row, last row + 1]
        for row, chunk in zip(rows.tolist(), chunk_of_row.tolist()):
            if runs and runs[-1][0] == chunk and runs[-1][2] == row:
                runs[-1][2] += 1
            else:
                runs.append([chunk, row, row + 1])
        needed = sorted({chunk for chunk, _, _ in runs})
        fetched = fetch_all([self.outputs[i] for i in needed], self.source, [self.ranks[i] for i in needed])
        pieces = {i: piece.unpad() for i, piece in zip(needed, fetched)}
        parts = [pieces[c][lo - int(starts[c]) : hi - int(starts[c])] for c, lo, hi in runs]
        out = parts[0] if len(parts) == 1 else Batch.concat(parts)
        if total % self.count:
            out.tensors[PAD_KEY] = torch.as_tensor(wanted >= total)
        return out
