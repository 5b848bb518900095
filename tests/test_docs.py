"""Every fenced block of the docs is run or checked, so an example cannot rot unnoticed.

Pages: README.md, CONTRIBUTING.md, bench/README.md, bench/results/journal.md and docs/*.md. A
block's language says its check:
- `python`: the blocks of one page run in order in one fresh process (cwd the repo root), sharing
  a namespace; tracebacks point at the page's lines. A `text output` block right after one holds
  what that block must print. `python notest` (first line `# notest: why`) is compiled, and every
  name it imports from workbench, algorithms or widgets must exist.
- `yaml`: a mapping whose keys are run-config sections is loaded as `python -m workbench run`
  loads it (RunConfig.from_dict: every field and value checked, no worker started); any other
  YAML must parse.
- `bash`, `sh`, `console`: each command as far as it can be checked without running it: `make`
  targets and variables against the Makefile, `python -m workbench SUB` against its commands (a
  `run` config loaded with its overrides), `python path.py` and every path under a folder of the
  repo must exist, `pip` extras must be the project's.
- `json` parses; `text` is not checked. A fence without a language fails.
Links to files and headings of the repo must resolve, and no page names a project issue.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        ROOT / "bench" / "README.md",
        ROOT / "bench" / "results" / "journal.md",
        *(ROOT / "docs").glob("*.md"),
    ]
)
PACKAGES = ("workbench", "algorithms", "widgets")
REPO_FOLDERS = ("algorithms", "bench", "configs", "docs", "notebooks", "tests", "widgets", "workbench")
"""A path in a command under one of these must exist (others, like runs/ or path/to/, are the
reader's)."""
FLAGS = {"python": {"notest"}, "text": {"output"}}
SHELLS = ("bash", "sh", "console")
PLAIN_COMMANDS = ("ray", "pip", "apt-get", "tensorboard", "git", "cd", "nvidia-smi", "jupyter")
"""Commands checked only for the repo paths and extras they name."""


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int
    """1-based line of the opening fence."""
    lang: str
    flags: tuple[str, ...]
    text: str

    @property
    def where(self) -> str:
        kind = " ".join((self.lang, *self.flags)) or "no language"
        return f"{page_id(self.page)}:{self.line} ({kind} block)"

    @property
    def runs(self) -> bool:
        return self.lang == "python" and "notest" not in self.flags


FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})(.*)$")


def parse(page: Path) -> tuple[list[Block], list[str]]:
    """The page's fenced blocks (CommonMark's rules, as far as the docs use them), and its lines
    outside any block."""
    lines = page.read_text().splitlines()
    blocks, prose, i = [], [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m or (m.group(2)[0] == "`" and "`" in m.group(3)):  # a backtick fence's info has no backtick
            prose.append(lines[i])
            i += 1
            continue
        indent, fence, info = len(m.group(1)), m.group(2), m.group(3).split()
        close = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), None)
        if end is None:
            blocks.append(Block(page, i + 1, "unclosed", (), ""))
            break
        body = [re.sub(rf"^ {{0,{indent}}}", "", line) for line in lines[i + 1 : end]]  # the fence's indent
        lang = info[0] if info else ""
        blocks.append(Block(page, i + 1, lang, tuple(info[1:]), "\n".join(body) + "\n"))
        i = end + 1
    return blocks, prose


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


# ---- python --------------------------------------------------------------------------------------
def check_notest(block: Block) -> list[str]:
    if not block.text.startswith("# notest:"):
        return ["a notest block starts with `# notest: <why it cannot run here>`"]
    try:
        tree = compile(block.text, block.where, "exec", ast.PyCF_ONLY_AST)
    except SyntaxError as error:
        return [f"does not compile: {error}"]
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            wanted = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            wanted = [(node.module, alias.name) for alias in node.names]
        else:
            continue
        for module, name in wanted:
            if module.split(".")[0] not in PACKAGES:
                continue
            try:
                owner = importlib.import_module(module)
            except ImportError as error:
                problems.append(f"imports {module}: {error}")
                continue
            if name and not hasattr(owner, name) and importlib.util.find_spec(f"{module}.{name}") is None:
                problems.append(f"{module} has no {name}")
    return problems


RUNNER = """
import json, sys
import __main__

_docs_blocks = json.load(sys.stdin)
for _docs_block in _docs_blocks:
    for _docs_stream in (sys.stdout, sys.stderr):
        print("\\n@@ " + _docs_block["where"], file=_docs_stream, flush=True)
    # Padded so that tracebacks name the page's own lines.
    _docs_code = compile("\\n" * _docs_block["line"] + _docs_block["text"], _docs_block["page"], "exec")
    exec(_docs_code, __main__.__dict__)
"""


def run_page(blocks: list[Block]) -> subprocess.CompletedProcess:
    payload = [{"where": b.where, "page": page_id(b.page), "line": b.line, "text": b.text} for b in blocks]
    return subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps(payload),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def expected_outputs(blocks: list[Block]) -> dict[str, str]:
    """A `text output` block's text, by the python block it follows."""
    return {before.where: block.text.strip() for before, block in zip(blocks, blocks[1:]) if "output" in block.flags}


# ---- yaml ----------------------------------------------------------------------------------------
def check_yaml(block: Block) -> list[str]:
    try:
        values = yaml.safe_load(block.text)
    except yaml.YAMLError as error:
        return [f"not valid YAML: {error}"]
    from workbench.run.config import RunConfig

    sections = {f.name for f in dataclasses.fields(RunConfig)}
    if not (isinstance(values, dict) and set(values) & sections):
        return []
    try:
        RunConfig.from_dict(values)
    except Exception as error:  # the loader's ConfigError, or whatever a value raised
        return [f"a run config `python -m workbench run` refuses: {error}"]
    return []


# ---- shell ---------------------------------------------------------------------------------------
@cache
def makefile() -> tuple[set[str], str]:
    text = (ROOT / "Makefile").read_text()
    targets = set()
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9_.\- ]+):(?!=)", line)
        if m and not line.startswith("\t"):
            targets.update(m.group(1).split())
    return targets, text


@cache
def workbench_commands() -> set[str]:
    tree = ast.parse((ROOT / "workbench" / "__main__.py").read_text())
    for node in ast.walk(tree):
        named = isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "COMMANDS" for t in node.targets)
        if named and isinstance(node.value, ast.Dict):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError("workbench/__main__.py has no COMMANDS table")


@cache
def extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def shell_commands(block: Block) -> list[list[str]]:
    lines = block.text.splitlines()
    if block.lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    joined, buffer = [], ""
    for line in lines:  # backslash continuations
        if line.rstrip().endswith("\\"):
            buffer += line.rstrip()[:-1] + " "
        else:
            joined.append(buffer + line)
            buffer = ""
    commands = []
    for line in joined:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        command: list[str] = []
        for token in lexer:
            if token and set(token) <= set("();<>|&"):
                commands.append(command)
                command = []
            else:
                command.append(token)
        commands.append(command)
    return [c for c in commands if c]


def check_paths(tokens: list[str]) -> list[str]:
    problems = []
    for token in tokens:
        value = token.split("=", 1)[1] if token.startswith("-") and "=" in token else token
        for extra in re.findall(r"^(?:hybridflow-workbench|\.)\[([\w,\-]+)\]$", value):
            problems += [f"pip extra [{e}] is not in pyproject.toml" for e in extra.split(",") if e not in extras()]
        if "/" in value and "://" not in value and value.split("/")[0] in REPO_FOLDERS:
            if not (ROOT / value).exists():
                problems.append(f"{value}: no such file in the repo")
    return problems


def check_make(args: list[str]) -> list[str]:
    targets, text = makefile()
    problems = []
    for arg in args:
        if arg.startswith("-"):
            continue
        if "=" in arg:
            name = arg.split("=", 1)[0]
            if not re.search(rf"\$\({name}\)|^{name}\s*[?:]?=", text, re.M):
                problems.append(f"make variable {name} is not used by the Makefile")
        elif arg not in targets:
            problems.append(f"make target {arg!r} is not in the Makefile")
    return problems


def check_python_command(args: list[str]) -> list[str]:
    if not args:
        return []
    if args[0] == "-c":
        try:
            compile(args[1], "<python -c>", "exec")
        except SyntaxError as error:
            return [f"python -c does not compile: {error}"]
        return []
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        if module != "workbench":
            return [] if importlib.util.find_spec(module) else [f"python -m {module}: no such module"]
        if not rest or rest[0] not in workbench_commands():
            return [f"python -m workbench {rest[:1]}: not one of {sorted(workbench_commands())}"]
        if rest[0] == "run" and len(rest) > 1:
            from workbench.run.config import load_config

            try:
                load_config(ROOT / rest[1], [a for a in rest[2:] if "=" in a])
            except Exception as error:
                return [f"python -m workbench run {' '.join(rest[1:])}: {error}"]
        return []
    script = args[0]
    return [] if (ROOT / script).exists() else [f"python {script}: no such file"]


def check_shell(block: Block) -> list[str]:
    problems = []
    for tokens in shell_commands(block):
        while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):  # VAR=value command
            tokens = tokens[1:]
        if not tokens:
            continue
        program, args = tokens[0], tokens[1:]
        problems += check_paths(args)
        if program == "make":
            problems += check_make(args)
        elif re.fullmatch(r"(.*/)?python3?(\.\d+)?", program):
            problems += check_python_command(args)
        elif program.endswith((".sh", ".py")) or program.startswith("./"):
            problems += check_paths([program.removeprefix("./")])
        elif program not in PLAIN_COMMANDS:
            problems.append(f"`{program}`: a command tests/test_docs.py does not know; teach it a check")
    return problems


# ---- any block -------------------------------------------------------------------------------------
def check_block(block: Block, previous: Block | None) -> list[str]:
    if not block.lang:
        return ["name the block's language (text for a picture or an output)"]
    if block.lang == "unclosed":
        return ["the fence is never closed"]
    unknown = set(block.flags) - FLAGS.get(block.lang, set())
    if unknown:
        return [f"unknown flags {sorted(unknown)}"]
    if block.lang == "python":
        return check_notest(block) if "notest" in block.flags else []
    if block.lang == "text":
        if "output" in block.flags and not (previous and previous.runs):
            return ["a `text output` block follows the python block that prints it"]
        return []
    if block.lang == "yaml":
        return check_yaml(block)
    if block.lang in SHELLS:
        return check_shell(block)
    if block.lang == "json":
        try:
            json.loads(block.text)
        except ValueError as error:
            return [f"not valid JSON: {error}"]
        return []
    return [f"no check for {block.lang!r} blocks: use a known language or teach tests/test_docs.py one"]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    _, prose = parse(page)
    return {slug(line.lstrip("#")) for line in prose if re.match(r"^#{1,6} ", line)}


def check_links(page: Path, prose: list[str]) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", "\n".join(prose))  # code spans hold no links
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"link to {target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"link to {target}: no such heading")
    return problems


def test_the_pages_are_the_docs():
    assert (ROOT / "README.md") in PAGES and len(PAGES) >= 10, PAGES
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150, "the README fits a screen: move detail to docs/"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_block_is_checked(page):
    blocks, prose = parse(page)
    problems = [
        f"{block.where}: {problem}"
        for previous, block in zip([None, *blocks], blocks)
        for problem in check_block(block, previous)
    ]
    problems += [f"{page_id(page)}: {problem}" for problem in check_links(page, prose)]
    for found in re.findall(r"\bissues?\s*#?\d+", "\n".join(prose), re.I):
        problems.append(f"{page_id(page)}: names a project issue ({found}): name the code or result instead")
    assert not problems, "\n".join(problems)


RUNNABLE = [page for page in PAGES if any(block.runs for block in parse(page)[0])]


@pytest.mark.parametrize("page", RUNNABLE, ids=page_id)
def test_python_blocks_run(page):
    blocks = parse(page)[0]
    run = run_page([b for b in blocks if b.runs])
    if run.returncode != 0:
        failed = re.findall(r"^@@ (.*)$", run.stderr, re.M)
        pytest.fail(f"{failed[-1] if failed else page_id(page)} failed:\n{run.stderr[-4000:]}")
    printed = dict(re.findall(r"^@@ (.*?)\n(.*?)(?=^@@ |\Z)", run.stdout, re.M | re.S))
    for where, expected in expected_outputs(blocks).items():
        got = printed.get(where, "")
        assert expected in got, f"{where} should print:\n{expected}\nbut printed:\n{got}"


def test_every_bench_script_compiles():
    """Bench scripts run by hand or on a lent GPU machine, where an error costs device time:
    each one compiles (the compiler's checks too: a `global` after its name's first use), and
    the shell scripts parse."""
    for path in sorted((ROOT / "bench").glob("*.py")):
        compile(path.read_text(), str(path), "exec")
    for path in sorted((ROOT / "bench").glob("*.sh")):
        checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert checked.returncode == 0, f"{path.name}: {checked.stderr}"
