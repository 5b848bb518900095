"""Run notebooks in a fresh kernel and store every cell's outputs, so a notebook read on a forge
shows its tables, answers and figures.

    .venv/bin/python notebooks/record_outputs.py                       # all of them
    .venv/bin/python notebooks/record_outputs.py notebooks/01_ppo_step_by_step.ipynb

Each notebook runs top to bottom in the project's kernel (the `python3` kernel of the Python that
runs this script); every code cell keeps what it printed and drew, with execution counts, and the
live widgets' state. A cell that raises stops that notebook and nothing is written for it; the
others go on. Prints each notebook's wall time and a total.

CI (nbval --nbval-lax) runs every notebook again and compares only the cells tagged
`nbval-check-output`; the other stored outputs are for readers.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
KERNEL = {"name": "hybridflow-workbench", "display_name": "HybridFlow Workbench", "language": "python"}
"""The kernelspec a notebook names: the one its setup cell tells a reader to install."""
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
MAX_WIDGET_STATE = 1_000_000
"""Bytes of widget state kept per notebook. Bokeh figures serialise their whole document; past
this the state would dwarf the notebook, and the PNG beside each view already shows the figure."""

# Start-up chatter on stderr that changes from run to run and says nothing about the result: Ray's
# own log lines (dated) and the warnings libraries print once per process. Results go to stdout.
NOISE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+(INFO|WARNING)\s.*"  # Ray's logger
    r"|\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d.*"  # C++ and glog lines
    r"|.*(UserWarning|FutureWarning|DeprecationWarning):.*|\s+warnings\.warn\(.*"
    r"|\(raylet\).*|.*Ray dashboard.*)$"
)
# Paths that differ between machines and runs, each written as a reader would type it.
PATHS = [
    (re.compile(re.escape(tempfile.gettempdir()) + r"/[\w.-]+"), "<tmp>"),
    (re.compile(re.escape(str(ROOT)) + r"(?=/|\b)"), "<repo>"),
    (re.compile(re.escape(str(Path.home())) + r"(?=/|\b)"), "~"),
    (re.compile(r"events\.out\.tfevents\.[\w.-]+"), "events.out.tfevents.<time>.<host>.<pid>"),
]


def clean_text(text: str) -> str:
    for pattern, replacement in PATHS:
        text = pattern.sub(replacement, text)
    return text


def clean(cell) -> None:
    """Drop volatile noise from a cell's outputs; never a result."""
    kept = []
    for output in cell.outputs:
        if output.output_type == "stream":
            lines = output.text.splitlines(keepends=True)
            if output.name == "stderr":
                lines = [line for line in lines if not NOISE.match(line.rstrip("\n"))]
            output.text = clean_text("".join(lines))
            if not output.text.strip():
                continue
        elif "data" in output and "text/plain" in output.data:
            output.data["text/plain"] = clean_text(output.data["text/plain"])
        kept.append(output)
    cell.outputs = kept


def record(path: Path) -> float:
    """Run `path` and write it back with its outputs; its wall time in seconds. Raises
    CellExecutionError (the notebook left as it was) when a cell fails."""
    notebook = nbformat.read(path, as_version=4)
    seconds: dict[int, float] = {}
    started: list[float] = []

    client = NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        store_widget_state=True,
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},
        on_cell_execute=lambda cell, cell_index: started.append(time.perf_counter()),
        on_cell_executed=lambda cell, cell_index, execute_reply: seconds.__setitem__(
            cell_index, time.perf_counter() - started[-1]
        ),
    )
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start

    for cell in notebook.cells:
        if cell.cell_type == "code":
            clean(cell)
    state = notebook.metadata.get("widgets", {}).get(WIDGET_STATE)
    if state is not None and len(nbformat.writes(nbformat.from_dict({"state": state}))) > MAX_WIDGET_STATE:
        del notebook.metadata["widgets"]
    notebook.metadata["kernelspec"] = KERNEL
    nbformat.write(notebook, path)

    slowest = sorted(seconds.items(), key=lambda item: -item[1])[:3]
    cells = ", ".join(f"cell {index} {s:.0f} s" for index, s in slowest)
    print(f"{path.name}: {elapsed:.0f} s ({cells}), {path.stat().st_size / 1e6:.2f} MB", flush=True)
    return elapsed


def main(args: list[str]) -> int:
    paths = [Path(arg) for arg in args] or sorted(HERE.glob("[0-9]*.ipynb"))
    total, failed = 0.0, []
    for path in paths:
        start = time.perf_counter()
        try:
            record(path)
        except CellExecutionError as error:
            failed.append(path.name)
            print(f"{path.name}: a cell failed, nothing written\n{error}", flush=True)
        total += time.perf_counter() - start
    print(f"total {total:.0f} s for {len(paths)} notebooks" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
