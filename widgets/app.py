"""The panel app: the placement explorer, and the live views of a run, in a browser.

    python -m workbench app                      # the explorer, at http://127.0.0.1:5006
    python -m workbench app --run runs/grpo      # + timeline and metrics of a run (live)
    python -m workbench app --compare runs/a --compare runs/b   # + runs overlaid (live)
    panel serve widgets/app.py --args --run runs/grpo

A run directory is what `widgets.RunRecorder` writes (`metrics.jsonl`, `trace.jsonl`,
`batches/`); the app reads them when they change and streams the new spans and metrics into
its figures, so it follows a run in progress as well as a finished one. Clicking a span of
the timeline opens its iteration's batch (while the recorder keeps it) or its metrics.
Bound to 127.0.0.1 unless told otherwise: the app has no authentication.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import panel as pn

from widgets.compare import RunComparison
from widgets.dashboard import MetricsDashboard
from widgets.explorer import PlacementExplorer
from widgets.recorder import batch_file, load_batch
from widgets.timeline import LiveTimeline


class RunFiles:
    """A run directory's metrics and trace, reloaded into the views when the files change."""

    def __init__(self, run_dir: str | Path, last_iterations: int | None = 3):
        self.run_dir = Path(run_dir)
        self.timeline = LiveTimeline(self.run_dir / "trace.jsonl", last_iterations=last_iterations)
        self.dashboard = MetricsDashboard.from_jsonl(self.run_dir / "metrics.jsonl")
        self.timeline.lookup = self.lookup
        self._stamps = self._mtimes()

    def lookup(self, run: str | None, iteration: int) -> dict:
        """An iteration's metrics, and its batch while the recorder still keeps it."""
        metrics = next((m for m in self.dashboard.history if m.get("iteration") == iteration), None)
        path = self.run_dir / "batches" / batch_file(run, iteration)
        try:
            batch = load_batch(path) if path.exists() else None
        except (OSError, RuntimeError):  # dropped by the recorder meanwhile
            batch = None
        return {"metrics": metrics, "batch": batch}

    def _mtimes(self) -> tuple:
        return tuple(
            p.stat().st_mtime_ns if p.exists() else 0
            for p in (self.run_dir / "trace.jsonl", self.run_dir / "metrics.jsonl")
        )

    def poll(self) -> bool:
        """Reload whichever file changed; True when something did."""
        stamps = self._mtimes()
        if stamps == self._stamps:
            return False
        if stamps[0] != self._stamps[0]:
            self.timeline.refresh()
        if stamps[1] != self._stamps[1]:
            self.dashboard.load(self.run_dir / "metrics.jsonl")
        self._stamps = stamps
        return True


def build(run_dir: str | Path | None = None, refresh_ms: int = 1000, compare: list | tuple = ()) -> pn.Tabs:
    """One browser session's app: fresh views, so sessions do not share state. `compare`: run
    directories overlaid in a tab of their own (with `run_dir` first, when given)."""
    tabs = [("Placement explorer", PlacementExplorer().panel())]
    served = pn.state.curdoc is not None  # then follow the files
    if run_dir is not None:
        files = RunFiles(run_dir)
        tabs += [("Live timeline", files.timeline.panel()), ("Metrics", files.dashboard.panel())]
        if served:
            pn.state.add_periodic_callback(files.poll, period=refresh_ms)
    if compare:
        comparison = RunComparison([*([run_dir] if run_dir is not None else []), *compare])
        tabs.append(("Compare runs", comparison.panel()))
        if served:
            pn.state.add_periodic_callback(comparison.reload, period=refresh_ms)
    return pn.Tabs(*tabs, dynamic=False)


def serve(
    run_dir: str | Path | None = None,
    address: str = "127.0.0.1",
    port: int = 5006,
    refresh_ms: int = 1000,
    compare: list | tuple = (),
) -> None:
    """Serve the app until interrupted."""
    following = [str(p) for p in ([run_dir] if run_dir else []) + list(compare)]
    print(
        f"HybridFlow Workbench app at http://{address}:{port}"
        + (f" following {', '.join(following)}" if following else ""),
        flush=True,
    )
    pn.serve(
        lambda: build(run_dir, refresh_ms, compare),
        address=address,
        port=port,
        show=False,
        allow_websocket_origin=[f"{address}:{port}"],
        title="HybridFlow Workbench",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workbench app", description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=None, help="a run directory written by widgets.RunRecorder")
    parser.add_argument(
        "--address", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this machine only)"
    )
    parser.add_argument("--port", type=int, default=5006)
    parser.add_argument("--refresh-ms", type=int, default=1000, help="how often to look for new spans and metrics")
    parser.add_argument(
        "--compare", type=Path, action="append", default=[], help="a run directory to overlay (repeat for each run)"
    )
    args = parser.parse_args(argv)
    if args.run is not None and not args.run.is_dir():
        parser.error(f"--run {args.run}: no such directory; pass the directory a RunRecorder writes")
    for path in args.compare:
        if not (path / "metrics.jsonl").is_file():
            parser.error(
                f"--compare {path}: no metrics.jsonl there; pass a directory the runner or a RunRecorder writes"
            )
    serve(args.run, args.address, args.port, args.refresh_ms, args.compare)


if __name__.startswith("bokeh"):  # `panel serve widgets/app.py --args --run DIR`
    import sys

    _run = sys.argv[sys.argv.index("--run") + 1] if "--run" in sys.argv else None
    build(_run).servable(title="HybridFlow Workbench")
