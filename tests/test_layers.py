"""The import structure CONTRIBUTING.md's Layout section draws: import-linter's contracts
(pyproject.toml) hold, no two modules import each other through any chain, CONTRIBUTING.md's layer
picture is the contract's, and every package of the workbench is placed in a layer. Pure: reads
the source, imports nothing of it."""

import re
import tomllib
from pathlib import Path

import grimp
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("workbench", "algorithms", "widgets")


def graph() -> grimp.ImportGraph:
    # Every import counts, those inside functions and under TYPE_CHECKING too.
    return grimp.build_graph(*PACKAGES, include_external_packages=False, cache_dir=None)


def contract_layers() -> list[str]:
    """The layers contract's layers, top first, without the marks of optional layers."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    return [" | ".join(name.strip().strip("()") for name in layer.split("|")) for layer in layers]


def drawn_layers() -> list[str]:
    """The first column of the layer picture in CONTRIBUTING.md's Layout section."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    fence = text.split("Layers, top to bottom", 1)[1].split("```", 2)[1]
    picture = fence.split("\n", 1)[1]  # the lines after the fence's language
    return [re.split(r"\s{2,}", line.strip())[0] for line in picture.strip().splitlines()]


def cycles(g: grimp.ImportGraph) -> list[list[str]]:
    """One shortest cycle per strongly connected group of modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in g.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = set()
            while module not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for module in sorted(g.modules):
        if module not in index:
            visit(module)
    found = []
    for group in groups:
        first = min(group)
        back = min(m for m in g.find_modules_directly_imported_by(first) if m in group)
        found.append([first, *g.find_shortest_chain(importer=back, imported=first)])
    return found


def test_import_contracts_hold(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT))
    broken = lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True, no_logo=True)
    assert broken == 0, "an import breaks a contract: the captured output (or `lint-imports`) names it"


def test_no_module_imports_itself_through_others():
    """import-linter's acyclic_siblings contract misses a package's __init__ in a circle with one
    of its own modules; this finds every circle."""
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_contributing_draws_the_contract():
    assert drawn_layers() == contract_layers()


def test_every_package_is_in_a_layer():
    placed = {name for layer in contract_layers() for name in layer.split(" | ")}
    g = graph()
    unplaced = sorted(m for m in g.find_children("workbench") if m not in placed)
    assert {"algorithms", "widgets"} <= placed
    assert not unplaced, f"place {unplaced} in the layers contract (pyproject.toml) and CONTRIBUTING.md's Layout"
