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
        new = [r for r in records if r.start >= self.since and _span_key(r) not in self._keys]
        # Every span the session still holds is written now; remembering just those keeps this
        # set as bounded as the session's own (Session.max_trace_records).
        self._keys = {_span_key(r) for r in records}
        save_records(new, self.trace_path, append=True)


def _span_key(record) -> tuple:
    """A span's identity: session.trace() keeps spans in start order, and a late one may start
    before spans already written, so a position cannot tell new from old."""
    return record.extra.get("call"), record.rank, record.method, record.start
