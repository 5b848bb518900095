"""The step clock: how long each step of an iteration took, and which spans belong to it.

`timing_s/<step>` is the wall time from when a step could start — its launch, or when the
results it was launched on became ready, whichever is later — to its own result being ready.
Steps that overlap on disjoint pools each show their own length, so `timing_s/step` (the
whole iteration) is less than their sum; colocated steps that queue behind each other include
their wait. In `Algorithm.step()` the clock watches every pending result; run cell by cell, a
step's time ends when its result was first asked for.

The clock also tags each launched call's trace spans with the iteration and step they belong
to (`extra["iteration"]`, `extra["step"]` in `session.trace()`), and with the algorithm's run
name (`extra["run"]`, e.g. "GRPO#2"), so a timeline can be read against the steps. Step names
come from `workbench.steps`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import ray


class StepClock:
    def __init__(self, run: str = ""):
        self.run = run
        """Which algorithm's spans these are (`extra["run"]`): a session may run several."""
        self.iteration = 1
        """The iteration the next launched steps belong to (1-based, as metrics["iteration"])."""
        self.reset()

    def reset(self) -> None:
        """Forget the steps timed so far (an iteration starts; a failed one leaves nothing behind)."""
        self.launched: dict[str, float] = {}
        self.pending: dict[str, list] = {}
        self.inputs: dict[str, set[str]] = {}  # step -> steps whose results it was launched on
        self.step_of: dict[int, str] = {}  # id(future) -> step
        self.finished: dict[str, float] = {}
        self.seconds: dict[str, float] = {}
        self.first: float | None = None

    def launch(self, step: str, future, *inputs):
        """Start timing `step`, whose result `future` (a DataFuture) will be ready later;
        `inputs` are the results it was launched on. Launched again before it finished, a
        step runs from its first launch to its last result."""
        now = time.monotonic()
        self.first = self.first or now
        tags = getattr(future, "trace_tags", None)
        if tags is not None:  # the call's spans in the trace get the iteration and step
            tags.update(run=self.run, iteration=self.iteration, step=step)
        refs = list(future.metas or future.outputs)
        if not refs:
            self.seconds[step] = 0.0
            return future
        self.launched.setdefault(step, now)
        self.pending[step] = self.pending.get(step, []) + refs
        self.inputs.setdefault(step, set()).update(self.step_of[id(i)] for i in inputs if id(i) in self.step_of)
        self.step_of[id(future)] = step
        return future

    def wait(self) -> None:
        """Block until every launched step is done, noting each one's finishing time."""
        refs = {ref: step for step, step_refs in self.pending.items() for ref in step_refs}
        remaining = list(refs)
        while remaining:
            done, remaining = ray.wait(remaining, num_returns=1, fetch_local=False)
            now = time.monotonic()
            for ref in done:
                step = refs[ref]
                self.pending[step].remove(ref)
                if not self.pending[step]:
                    self.finished[step] = now
        for step, launched in self.launched.items():
            ready = max([launched] + [self.finished.get(s, launched) for s in self.inputs.get(step, ())])
            self.seconds[step] = self.finished.get(step, ready) - ready
        self.launched, self.pending = {}, {}

    @contextmanager
    def measure(self, step: str):
        """Time a driver-side step (advantages, KL shaping) run inside the block."""
        start = time.monotonic()
        self.first = self.first or start
        try:
            yield
        finally:
            self.seconds[step] = self.seconds.get(step, 0.0) + time.monotonic() - start

    def report(self) -> dict[str, float]:
        """timing_s/* for everything since the last reset, then reset (the next iteration begins)."""
        self.wait()
        out = {f"timing_s/{k}": v for k, v in self.seconds.items()}
        out["timing_s/step"] = time.monotonic() - self.first if self.first else 0.0
        self.reset()
        self.iteration += 1
        return out
