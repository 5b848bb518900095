"""Span records of every remote call, and their export to Chrome/Perfetto trace JSON.

Each worker host appends one CallRecord per call it runs; the session drains them on demand
(`session.trace()`), without waiting for calls in flight. Every span carries the driver call it
belongs to (`extra["call"]`) and, once an algorithm launched it, the iteration and step
(`extra["iteration"]`, `extra["step"]`: see workbench.clock and workbench.steps); `tags(...)`
adds tags of your own to the calls a block of code issues. The same records feed the timeline
widget and the planner's calibration.
Open an exported file at https://ui.perfetto.dev or chrome://tracing; `save_records` /
`load_records` keep them whole (JSON lines) for the panel app.

Every worker call's span also carries its process's memory high-water marks
(`process_memory`: peak RSS, and the CUDA allocator's peak on a GPU); `memory_metrics` turns
the latest of them into one figure per role and rank (`perf/peak_rss_gib/actor/rank0`, ...).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import json
import resource
import sys
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

# Read-only default: tags() sets a fresh dict, so nothing can change the empty one in place.
_TAGS: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "workbench_trace_tags", default=MappingProxyType({})
)
_CALL_NUMBERS = itertools.count()


def new_call_number() -> int:
    """A driver call's number, unique in this process: it ties every span of the call to its tags."""
    return next(_CALL_NUMBERS)


class SpanSource(Protocol):
    """Spans recorded outside worker groups (the rule-reward scorers), drained with the host
    sets' by `session.trace()`: every source is asked first, then all answers are waited for
    together."""

    drains: list
    """Its drain_records calls (Ray refs) that have not answered yet."""

    def request_records(self) -> None:
        """Ask for the spans recorded since the last ask (adds to `drains`)."""

    def take_records(self, answers: dict) -> list[CallRecord]:
        """The spans of the `drains` that `answers` ({ref: spans}) holds, tagged; the rest
        stay in `drains` for the next drain."""
        ...


MAX_CALL_TAGS = 100_000
"""Calls whose tags a CallTags keeps at most (a dead rank's spans never come to settle them)."""


class CallTags:
    """The tags of driver calls whose spans have not all been drained yet: kept from the call
    (`keep`, with how many spans it will have) until each of them has been taken (`settle`), so
    a long run keeps only the calls in flight; at most `limit`."""

    def __init__(self, limit: int = MAX_CALL_TAGS):
        self.limit = limit
        self._tags: OrderedDict[int, dict] = OrderedDict()
        self._due: dict[int, int] = {}  # call number -> spans not taken yet

    def keep(self, number: int, tags: dict, spans: int) -> dict:
        """Keep call `number`'s tags; the dict returned can still be added to (the step clock
        adds iteration and step) until the call's spans are taken."""
        self._tags[number], self._due[number] = tags, spans
        while len(self._tags) > self.limit:
            self._due.pop(self._tags.popitem(last=False)[0], None)
        return tags

    def of(self, number: int | None) -> dict:
        return self._tags.get(number, {}) if number is not None else {}

    def settle(self, number: int | None) -> None:
        """One of call `number`'s spans was taken (its tags go with the last)."""
        if number in self._due:
            self._due[number] -= 1
            if self._due[number] <= 0:
                del self._due[number], self._tags[number]

    def __len__(self) -> int:
        return len(self._tags)


def take_answers(drains: list, answers: dict) -> tuple[list[CallRecord], list]:
    """The spans `answers` ({ref: spans}) holds for `drains`, and the drains not answered yet
    (kept for the next drain, so no span is lost)."""
    records = [r for ref in drains if ref in answers for r in answers[ref]]
    return records, [ref for ref in drains if ref not in answers]


_SPAN_SOURCES: list[SpanSource] = []


def add_span_source(source: SpanSource) -> None:
    """Have `session.trace()` also drain `source`."""
    if source not in _SPAN_SOURCES:
        _SPAN_SOURCES.append(source)


def remove_span_source(source: SpanSource) -> None:
    if source in _SPAN_SOURCES:
        _SPAN_SOURCES.remove(source)


def span_sources() -> list[SpanSource]:
    return list(_SPAN_SOURCES)


@contextlib.contextmanager
def tags(**values) -> Iterator[dict]:
    """Tag the spans of every call issued inside the block, e.g. `with tags(step="probe"):`."""
    block = {**_TAGS.get(), **values}
    token = _TAGS.set(block)
    try:
        yield block
    finally:
        _TAGS.reset(token)


def current_tags() -> dict:
    """The tags `tags(...)` blocks set around this point (empty outside any)."""
    return dict(_TAGS.get())


@dataclass(frozen=True)
class CallRecord:
    """One rank's run of one call."""

    call_id: int
    """Same for every rank of one driver-side call."""
    role: str
    method: str
    rank: int
    pool: str
    pid: int
    start: float
    """Wall-clock seconds when the rank began (after waiting for earlier calls on its pool)."""
    fetched: float
    """When its inputs had arrived (RemoteSlices resolved); fetched - start is transfer time."""
    end: float
    bytes_in: int
    bytes_out: int
    ok: bool
    extra: dict = field(default_factory=dict)
    """Anything else the worker measured (e.g. a weight sync's peak memory)."""
    node: str = ""
    """The address of the host it ran on: on a cluster, bytes_in on one host of rows made on
    another crossed the network."""

    @property
    def seconds(self) -> float:
        return self.end - self.start


def to_chrome_trace(records: Iterable[CallRecord]) -> dict:
    """Chrome trace-event JSON: one process row per pool, one thread row per rank."""
    records = sorted(records, key=lambda r: r.start)
    if not records:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = records[0].start
    pools = {name: i for i, name in enumerate(dict.fromkeys(r.pool for r in records))}
    events = []
    for name, pid in pools.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": f"pool {name}"}})
    for r in records:
        common = {"pid": pools[r.pool], "tid": r.rank}
        if r.fetched - r.start > 1e-6:
            events.append(
                {
                    **common,
                    "name": f"fetch inputs ({r.role}.{r.method})",
                    "ph": "X",
                    "cat": "transfer",
                    "ts": (r.start - t0) * 1e6,
                    "dur": (r.fetched - r.start) * 1e6,
                    "args": {"bytes_in": r.bytes_in},
                }
            )
        events.append(
            {
                **common,
                "name": f"{r.role}.{r.method}",
                "ph": "X",
                "cat": r.role,
                "ts": (r.fetched - t0) * 1e6,
                "dur": (r.end - r.fetched) * 1e6,
                "args": {
                    **{
                        k: v
                        for k, v in asdict(r).items()
                        if k in ("call_id", "rank", "node", "bytes_in", "bytes_out", "ok")
                    },
                    **r.extra,
                },
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def save_chrome_trace(records: Iterable[CallRecord], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(to_chrome_trace(records)))
    return path


def save_records(records: Iterable[CallRecord], path: str | Path, append: bool = False) -> Path:
    """CallRecords as JSON lines (one span a line); `append` adds to an existing file."""
    path = Path(path)
    with path.open("a" if append else "w") as f:
        for r in records:
            f.write(json.dumps(asdict(r), default=float) + "\n")
    return path


def load_records(path: str | Path) -> list[CallRecord]:
    """The spans `save_records` wrote, in start order (a half-written last line is skipped)."""
    records = []
    for line in Path(path).read_text().splitlines():
        try:
            records.append(CallRecord(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue  # a writer may be mid-line
    return sorted(records, key=lambda r: r.start)


def text_timeline(records: Iterable[CallRecord], width: int = 60) -> str:
    """A terminal Gantt chart: one line per (pool, rank), one letter per role."""
    records = sorted(records, key=lambda r: r.start)
    if not records:
        return "(no calls recorded)"
    t0, t1 = records[0].start, max(r.end for r in records)
    scale = width / max(t1 - t0, 1e-9)
    letters = {role: chr(ord("A") + i) for i, role in enumerate(dict.fromkeys(r.role for r in records))}
    rows: dict[tuple[str, int], list[str]] = {}
    for r in records:
        row = rows.setdefault((r.pool, r.rank), [" "] * width)
        lo = min(width - 1, int((r.fetched - t0) * scale))
        hi = max(lo + 1, min(width, int((r.end - t0) * scale)))
        row[lo:hi] = letters[r.role] * (hi - lo)
    label = max(len(f"{p} rank {k}") for p, k in rows)
    lines = [f"{f'{p} rank {k}':<{label}} |{''.join(cells)}|" for (p, k), cells in sorted(rows.items())]
    legend = ", ".join(f"{c}={role}" for role, c in letters.items())
    return "\n".join([*lines, f"{'':<{label}}  0 s{'':>{width - 10}}{t1 - t0:.2f} s", f"legend: {legend}"])


# ---- memory per process ----------------------------------------------------------------------------
GIB = 2**30


def process_memory() -> dict[str, int]:
    """This process's memory high-water marks: `peak_rss_bytes` (the kernel's maximum resident
    set since the process started, or was reset to serve a new group) and `cuda_peak_bytes`
    (torch's allocator peak) where CUDA is in use. A few microseconds: cheap enough for every call."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = {"peak_rss_bytes": peak if sys.platform == "darwin" else peak * 1024}  # Linux counts KiB
    torch = sys.modules.get("torch")  # only where torch is loaded already: tracing imports no torch
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated())
    return out


def reset_memory_peaks() -> None:
    """Start process_memory's high-water marks afresh (Linux: the kernel's peak RSS)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:  # not Linux, or not allowed: the peaks then count from the process's start
        pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def memory_metrics(records: Iterable[CallRecord]) -> dict[str, float]:
    """One peak per role and rank from the spans' process_memory figures, the latest span of each
    winning: `perf/peak_rss_gib/<role>/rank<r>` and, on GPUs, `perf/cuda_peak_gib/<role>/rank<r>`.
    Roles fused in one process (actor + reference, critic + cost critic) report that process's."""
    latest: dict[tuple[str, int], CallRecord] = {}
    for record in records:
        if "peak_rss_bytes" in record.extra:
            key = (record.role, record.rank)
            if key not in latest or record.end >= latest[key].end:
                latest[key] = record
    out = {}
    for (role, rank), record in sorted(latest.items()):
        out[f"perf/peak_rss_gib/{role}/rank{rank}"] = record.extra["peak_rss_bytes"] / GIB
        if "cuda_peak_bytes" in record.extra:
            out[f"perf/cuda_peak_gib/{role}/rank{rank}"] = record.extra["cuda_peak_bytes"] / GIB
    return out
