"""RunRecorder: a `fit` callback that writes a run's metrics and trace as it goes.

    recorder = RunRecorder("runs/grpo", session)
    grpo.fit(prompts, 10, callbacks=[recorder])
    # elsewhere: python -m workbench app --run runs/grpo    (follows the files live)

`metrics.jsonl` gets one line per iteration, `trace.jsonl` the spans that arrived since the
last iteration (`workbench.tracing.save_records`), and `batches/` the last `keep_batches`
iterations' batches (tensors and text columns, read back with `load_batch`), which the app's
timeline opens in a BatchInspector when a span is clicked.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from workbench.data.batch import Batch
from workbench.tracing import save_records


class RunRecorder:
    """Appends each iteration's metrics and new trace spans under `run_dir`."""

    def __init__(self, run_dir: str | Path, session=None, since: float | None = None, keep_batches: int = 2):
        """since: record spans that started at or after this `time.time()` (default: now; a
        session's trace also holds the spans of its earlier runs); keep_batches: how many of
        the latest iterations' batches stay on disk (0: none)."""
        if not isinstance(keep_batches, int) or keep_batches < 0:
            raise ValueError(f"RunRecorder: keep_batches must be a whole number >= 0, got {keep_batches!r}")
        self.keep_batches = keep_batches
        self.run_dir = Path(run_dir)
        self.since = time.time() if since is None else since
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.session = session
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.trace_path = self.run_dir / "trace.jsonl"
        self.metrics_path.write_text("")
        self.trace_path.write_text("")
        self._cursor = 0  # session.spans_since's: the spans written so far

    def __call__(self, algorithm=None, batch=None, metrics=None) -> None:
        if batch is not None and metrics is not None and "iteration" in metrics and self.keep_batches:
            self.save_batch(batch, getattr(algorithm, "run_name", None), int(metrics["iteration"]))
        if metrics is not None:
            with self.metrics_path.open("a") as f:
                f.write(json.dumps({k: float(v) for k, v in metrics.items()}) + "\n")
        self.save_trace()

    def save_batch(self, batch: Batch, run: str | None, iteration: int) -> Path:
        """Write an iteration's batch under batches/ and drop the ones past `keep_batches`."""
        folder = self.run_dir / "batches"
        folder.mkdir(exist_ok=True)
        path = folder / batch_file(run, iteration)
        save_batch(batch, path)
        saved = sorted(folder.glob("*.pt"), key=lambda p: p.stat().st_mtime_ns)
        for old in saved[: max(0, len(saved) - self.keep_batches)]:
            old.unlink(missing_ok=True)
        return path

    def save_trace(self) -> None:
        """Append the spans that arrived since the last call."""
        if self.session is None:
            return
        new, self._cursor = self.session.spans_since(self._cursor)
        save_records(
            sorted((r for r in new if r.start >= self.since), key=lambda r: r.start), self.trace_path, append=True
        )


def batch_file(run: str | None, iteration: int) -> str:
    return f"{(run or 'run').replace('#', '-').replace('/', '-')}-it{iteration}.pt"


def save_batch(batch: Batch, path: str | Path) -> None:
    """Tensors and columns (as plain lists) only, so `load_batch` reads it with
    `torch.load(weights_only=True)`: opening a run's files runs no pickled code."""
    columns = {
        k: [v if isinstance(v, (str, int, float, bool)) else str(v) for v in c.tolist()]
        for k, c in batch.columns.items()
    }
    tmp = Path(path).with_suffix(".tmp")
    torch.save({"tensors": {k: batch.tensors[k] for k in batch.tensors.keys()}, "columns": columns}, tmp)
    tmp.replace(path)  # readers never see half a file


def load_batch(path: str | Path) -> Batch:
    saved = torch.load(path, weights_only=True)
    return Batch(saved["tensors"], columns=saved["columns"])
