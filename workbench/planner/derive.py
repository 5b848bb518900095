"""Dataflows read off the algorithm files, so the planner plans what `step()` really does.

`derive_dataflow(algorithms.PPO)` parses the class's `step()` (its source, not a run) and turns
every call on `self` that runs a worker step of `workbench.steps` into a model function call
named as the step, with dependencies from the variables its arguments come from:

    gen = self.generate(prompts)                     -> gen
    batch = self.collect(gen, self.values(gen), ...) -> values (deps: gen), ...
    self.update_actor(batch)                         -> update_actor (deps: all calls in batch)

A call naming its step (`self.reward(greedy, step="reward_greedy")`) is that step's row; a
name the table does not have keeps the method's default row's role and kind. Driver-side
steps (advantages, KL shaping) are not model calls. Calls under a condition (GRPO's reference
pass when the KL loss is on, Safe-RLHF's ptx step) are included: the plan is for the algorithm
with its options on.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import textwrap
from pathlib import Path
from typing import Any, TypeGuard

from workbench import steps
from workbench.planner.dataflow import Call, Dataflow
from workbench.planner.errors import UnknownPresetError

STEP_METHODS = tuple(dict.fromkeys(s.algorithm_method for s in steps.STEPS if s.kind != "driver"))
"""The Algorithm methods that run a worker step: each such call in step() is a model call."""
VALUE_ROLES = ("critic", "reward", "cost", "cost_critic")


class DeriveError(ValueError):
    """The algorithm's step() is not in a form the planner can read."""


def derive_dataflow(algorithm: type[Any], name: str | None = None) -> Dataflow:
    """The dataflow of one iteration of `algorithm` (a subclass of algorithms.Algorithm)."""
    try:
        source = textwrap.dedent(inspect.getsource(algorithm.step))
    except (OSError, TypeError) as err:
        raise DeriveError(f"cannot read the source of {algorithm.__name__}.step: {err}") from None
    return _dataflow(ast.parse(source), algorithm.__name__, name)


def _dataflow(step: ast.AST, owner: str, name: str | None) -> Dataflow:
    reader = _StepReader()
    reader.visit(step)
    if not reader.calls:
        raise DeriveError(f"{owner}.step makes no step calls ({sorted(STEP_METHODS)})")
    roles = {c.model for c in reader.calls}
    return Dataflow(name or owner.lower(), tuple(reader.calls), tuple(r for r in VALUE_ROLES if r in roles))


class _StepReader(ast.NodeVisitor):
    def __init__(self):
        self.calls: list[Call] = []
        self.produced_by: dict[str, tuple[str, ...]] = {}  # variable -> calls its value came from

    def visit_Assign(self, node: ast.Assign) -> None:
        sources = self._sources(node.value)
        for target in node.targets:
            for name in _names(target):
                self.produced_by[name] = sources
            if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):  # batch["x"] = ...
                base = target.value.id
                self.produced_by[base] = tuple(dict.fromkeys(self.produced_by.get(base, ()) + sources))

    def visit_Expr(self, node: ast.Expr) -> None:
        self._sources(node.value)

    def visit_Return(self, node: ast.Return) -> None:
        if node.value is not None:
            self._sources(node.value)

    def visit_If(self, node: ast.If) -> None:
        for statement in node.body + node.orelse:
            self.visit(statement)

    def _sources(self, node: ast.AST) -> tuple[str, ...]:
        """Record the step calls inside `node` (innermost first); the calls its value comes from."""
        if isinstance(node, ast.Name):
            return self.produced_by.get(node.id, ())
        if isinstance(node, ast.Call) and _is_self_method(node.func) and node.func.attr in STEP_METHODS:
            deps = self._arg_sources(node)
            return (self._add(node, deps),)
        out: tuple[str, ...] = ()
        for child in ast.iter_child_nodes(node):
            out += self._sources(child)
        return tuple(dict.fromkeys(out))

    def _arg_sources(self, node: ast.Call) -> tuple[str, ...]:
        deps: tuple[str, ...] = ()
        for arg in list(node.args) + [k.value for k in node.keywords]:
            deps += self._sources(arg)
        return tuple(dict.fromkeys(deps))

    def _add(self, node: ast.Call, deps: tuple[str, ...]) -> str:
        assert isinstance(node.func, ast.Attribute)  # a self.<method>(...) call (_is_self_method)
        method = node.func.attr
        default = steps.default_step(method)  # a method in STEP_METHODS runs a worker step
        assert default is not None
        call_name = _step_keyword(node) or default.name
        row = steps.BY_NAME.get(call_name, default)
        role, kind = _role_argument(node) or row.role, row.kind
        if kind == "driver":
            raise DeriveError(
                f"step() names the driver-side step {call_name!r} in a call of {method}; "
                f"name a worker step (workbench.steps) or one of your own"
            )
        if any(c.name == call_name for c in self.calls):
            raise DeriveError(f"step() calls {call_name!r} twice; give one a step=... name (workbench.steps)")
        if kind == "train":  # a model's updates apply in the order they were issued
            previous = [c.name for c in self.calls if c.model == role and c.kind == "train"]
            deps = tuple(dict.fromkeys(deps + tuple(previous[-1:])))
        self.calls.append(Call(call_name, role, kind, deps))
        return call_name


def _is_self_method(func: ast.AST) -> TypeGuard[ast.Attribute]:
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"


def _step_keyword(node: ast.Call) -> str | None:
    """The step a call names: step="..."."""
    return next(
        (
            k.value.value
            for k in node.keywords
            if k.arg == "step" and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)
        ),
        None,
    )


def _role_argument(node: ast.Call) -> str | None:
    """A step run on another group, e.g. update_critic(batch, self.groups.cost_critic, ...)."""
    for arg in list(node.args) + [k.value for k in node.keywords]:
        if isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Attribute) and arg.value.attr == "groups":
            return arg.attr
    return None


def _names(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for element in target.elts for n in _names(element)]
    return []


def dataflow_preset(name: str) -> Dataflow:
    """The dataflow of a built-in algorithm (`algorithms.ALGORITHMS`: ppo, grpo, remax,
    safe_rlhf, rloo, reinforce_pp), read off its `step()` so plan and code cannot drift. The
    files are read, not imported: the planner stays free of the model stack."""
    presets = _built_in()
    key = name.lower().replace("-", "_")
    if key not in presets:
        raise UnknownPresetError("dataflow", name, list(presets))
    path, class_name = presets[key]
    tree = ast.parse(path.read_text(), str(path))
    [owner] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    [step] = [n for n in owner.body if isinstance(n, ast.FunctionDef) and n.name == "step"]
    return _dataflow(step, class_name, key)


def _built_in() -> dict[str, tuple[Path, str]]:
    """algorithms.ALGORITHMS as (file, class name) per key, read off `algorithms/__init__.py`
    (found without running it)."""
    spec = importlib.util.find_spec("algorithms")
    if spec is None or spec.origin is None:
        raise UnknownPresetError("dataflow", "algorithms", [])
    init = Path(spec.origin)
    tree = ast.parse(init.read_text(), str(init))
    module_of = {
        alias.asname or alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }
    [table] = [
        n.value
        for n in tree.body
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ALGORITHMS" for t in n.targets)
    ]
    assert isinstance(table, ast.Dict)
    return {
        key.value: (init.parent / f"{module_of[value.id].rsplit('.', 1)[1]}.py", value.id)
        for key, value in zip(table.keys, table.values)
        if isinstance(key, ast.Constant) and isinstance(key.value, str) and isinstance(value, ast.Name)
    }
