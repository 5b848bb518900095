"""RunRecorder: a `fit` callback that writes a run's metrics and trace as it goes.

    recorder = RunRecorder("runs/grpo", session)
    grpo.fit(prompts, 10, callbacks=[recorder])
    # elsewhere: python -m workbench app --run runs/grpo    (follows the files live)

`metrics.jsonl` gets one line per iteration, `trace.jsonl` the spans that arrived since the
last iteration (`workbench.tracing.save_records`).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from workbench.tracing import save_records


class RunRecorder:
    """Appends each iteration's metrics and new trace spans under `run_dir`."""

    def __init__(self, run_dir: str | Path, session=None, since: float | None = None):
        """since: record spans that started at or after this `time.time()` (default: now; a
        session's trace also holds the spans of its earlier runs)."""
        self.run_dir = Path(run_dir)
        self.since = time.time() if since is None else since
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.session = session
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.trace_path = self.run_dir / "trace.jsonl"
        self.metrics_path.write_text("")
        self.trace_path.write_text("")
        self._keys: set = set()  # spans already written

    def __call__(self, algorithm=None, batch=None, metrics=None) -> None:
        if metrics is not None:
            with self.metrics_path.open("a") as f:
                f.write(json.dumps({k: float(v) for k, v in metrics.items()}) + "\n")
        self.save_trace()

    def save_trace(self) -> None:
        """Append the spans that arrived since the last call."""
        if self.session is None:
            return
        records = self.session.trace()
        # session.trace() keeps every span it ever drained, in start order; new ones may start
        # before old ones, so write those not written yet by identity of (call, rank, method, start).
        written = self._keys
        new = [r for r in records if r.start >= self.since
               and (r.extra.get("call"), r.rank, r.method, r.start) not in written]
        written.update((r.extra.get("call"), r.rank, r.method, r.start) for r in new)
        save_records(new, self.trace_path, append=True)
