"""The notebooks as a reader on a forge sees them: stored outputs, figures included
(notebooks/record_outputs.py records them), a setup cell first, no project issue named. Reads the
.ipynb files only: no kernel runs here (nbval runs them, `make test`)."""

import copy
import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9]*.ipynb"))
ISSUE = re.compile(r"\bissues?\s*#?\d+|(?<![\w&])#\d+\b", re.IGNORECASE)
"""`issue 27`, `issues 5`, `#27`; not `GRPO#1` (an algorithm's run name) nor `&#39;`."""


def tags(cell: dict) -> list[str]:
    return cell.get("metadata", {}).get("tags", [])


def source(cell: dict) -> str:
    text = cell.get("source", "")
    return "".join(text) if isinstance(text, list) else text


def images(cell: dict) -> int:
    return sum("image/png" in output.get("data", {}) for output in cell.get("outputs", []))


def problems(notebook: dict) -> list[str]:
    """What a reader would miss in this notebook, one line each (empty: nothing)."""
    cells = notebook["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    found = []
    if not any(images(c) for c in code):
        found.append("no stored figure (image/png)")
    shown = sum(bool(c.get("outputs")) for c in code)
    if 2 * shown < len(code):
        found.append(f"outputs on {shown} of {len(code)} code cells (fewer than half)")
    results = [i for i, c in enumerate(cells) if "result" in tags(c)]
    if not results:
        found.append("no cell tagged `result` (the cells that compute a figure, a table or a before/after)")
    found += [f"cell {i} is tagged `result` but has no stored output" for i in results if not cells[i].get("outputs")]
    first_code = next((i for i, c in enumerate(cells) if c["cell_type"] == "code"), None)
    setup = [i for i, c in enumerate(cells) if "setup" in tags(c)]
    if first_code is None or "setup" not in tags(cells[first_code]) or "needs(" not in source(cells[first_code]):
        found.append("the first code cell is not the setup check (tagged `setup`, calling workbench.needs)")
    if not any(cells[i]["cell_type"] == "markdown" and "ipykernel install" in source(cells[i]) for i in setup):
        found.append("no setup markdown cell (tagged `setup`) saying which kernel to install and pick")
    elif first_code is not None and any(c["cell_type"] == "code" for c in cells[: min(setup)]):
        found.append("code runs before the setup cells")
    for i, cell in enumerate(cells):
        texts = [source(cell)] + [
            "".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
            for o in cell.get("outputs", [])
        ]
        # Outputs hold colour codes and run names (`#1f77b4`, `GRPO#1`): only `issue N` counts there.
        hits = ISSUE.findall(texts[0]) + [m for t in texts[1:] for m in re.findall(r"(?i)\bissues?\s*\d+", t)]
        found += [f"cell {i} names a project issue: {hit!r}" for hit in hits]
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_notebook_shows_its_results(path):
    found = problems(json.loads(path.read_text()))
    assert not found, f"{path.name}: " + "; ".join(found) + " (re-record: .venv/bin/python notebooks/record_outputs.py)"


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 9


def test_the_check_reports_a_stripped_notebook():
    notebook = json.loads(NOTEBOOKS[0].read_text())
    assert problems(notebook) == []
    stripped = copy.deepcopy(notebook)
    for cell in stripped["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"], cell["execution_count"] = [], None
    found = problems(stripped)
    assert "no stored figure (image/png)" in found
    assert any("fewer than half" in line for line in found)
    assert any("tagged `result` but has no stored output" in line for line in found)


def test_the_check_reports_a_missing_setup_cell_and_an_issue_reference():
    notebook = json.loads(NOTEBOOKS[0].read_text())
    changed = copy.deepcopy(notebook)
    changed["cells"] = [c for c in changed["cells"] if "setup" not in tags(c)]
    changed["cells"][0]["source"] = "# A title\n\nAs promised in issue 12 (see #12)."
    found = problems(changed)
    assert any("not the setup check" in line for line in found)
    assert any("no setup markdown cell" in line for line in found)
    assert [line for line in found if "names a project issue" in line] == [
        "cell 0 names a project issue: 'issue 12'",
        "cell 0 names a project issue: '#12'",
    ]
